"""Rollouts as a service: `rollwise serve` (an HTTP API over one engine) and its client `ServiceRollouts`
(`rollout.source = "service"`). See docs/serve.md."""
