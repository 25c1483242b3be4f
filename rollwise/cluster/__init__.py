"""Ray placement (`[cluster] ray = true`): engine workers and trainer ranks as Ray actors.

- `Cluster`: the Ray connection (a local cluster on 127.0.0.1, or `cluster.address`) and the placement groups,
  one bundle per engine worker and per trainer rank above 0 (rank 0 is the driver process: it runs the loop).
- `RemoteEngine`: the engine contract (`generate`, `abort`, `update_weights`, `version`, `stats`, `dtype`, `device`,
  `close`, and per `caps`: `reload_from`, `probe_logprobs`, `rng_state`, `update_adapter` for vLLM workers) over
  `EngineWorker` actors (torch or vllm engines).
- `start_trainer_ranks`: ranks 1..N-1 as actors running `rollwise.train.launch.worker_main`.
- `WorkerError`: an actor that failed or died, named (engine worker k / trainer rank r), with its last line.

Ray is imported only when a cluster starts: a plain install does not need it.
"""

from rollwise.cluster.engines import RemoteEngine, engine_spec, split_requests
from rollwise.cluster.errors import WorkerError
from rollwise.cluster.placement import Cluster
from rollwise.cluster.trainers import RankProcess, TrainerRanks, start_trainer_ranks
from rollwise.cluster.worker import EngineSpec, EngineWorker

__all__ = ["Cluster", "EngineSpec", "EngineWorker", "RankProcess", "RemoteEngine", "TrainerRanks", "WorkerError",
           "engine_spec", "split_requests", "start_trainer_ranks"]
