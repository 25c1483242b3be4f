"""The error of a dataset a user gave (`data.path`, `data.eval_path`, demonstrations)."""

from rollwise.errors import UserError


class DatasetError(UserError, ValueError):
    """A dataset is missing, unreadable or has a bad row; the message says where and what was expected."""
