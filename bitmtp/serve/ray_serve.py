"""Scale-out on Ray Serve: the same FastAPI app (:func:`bitmtp.serve.create_app`) as a Ray Serve
deployment, one model per replica. Ray's HTTP proxy routes requests among the replicas; bitmtp adds no
router of its own. Each replica loads the model itself (a path, not a live model, crosses to it) and
reports Ray's replica id in the ``x-bitmtp-replica`` header and the ``"bitmtp"`` extension field.

``python -m bitmtp serve --replicas N`` runs this on a local Ray cluster; against an existing cluster::

    import ray
    from ray import serve
    from bitmtp.serve import ray_app

    ray.init(address="auto")
    serve.start(http_options={"host": "0.0.0.0", "port": 8000})
    serve.run(ray_app("model.gguf", replicas=4), route_prefix="/")
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bitmtp.errors import BitMTPError
from bitmtp.serve.app import BODY_TIMEOUT, DEFAULT_MAX_BATCH, STREAM_INTERVAL


def require_ray() -> None:
    """Raise a BitMTPError naming the extra to install when Ray Serve (or FastAPI) is missing."""
    try:
        import ray  # noqa: F401
        from ray import serve  # noqa: F401
    except ImportError:
        raise BitMTPError("serve: --replicas runs on Ray Serve, which is not installed; pip install "
                          "'bitmtp[ray]'") from None
    from bitmtp.serve.app import require_serve

    require_serve()


def _replica_id() -> str:
    """This replica's id in Ray Serve (called at the app's startup, inside the replica)."""
    from ray import serve

    return serve.get_replica_context().replica_id.unique_id


def ray_app(model: str | Path, *, replicas: int = 2, model_name: str | None = None, sessions: int = 1,
            queue_size: int = 16, load_kwargs: dict[str, Any] | None = None,
            ray_actor_options: dict[str, Any] | None = None, deployment_name: str = "bitmtp",
            body_timeout: float | None = BODY_TIMEOUT, stream_interval: float = STREAM_INTERVAL,
            max_batch: int = DEFAULT_MAX_BATCH, solo_when_idle: bool = False, calibrate: bool = True) -> Any:
    """A Ray Serve application serving ``model`` from ``replicas`` replicas; each replica batches the requests
    it decodes (``max_batch``).

    Args:
        model: a model path (``.gguf`` file or checkpoint folder) every replica loads with
            :func:`bitmtp.load` (plus ``load_kwargs``, e.g. ``{"capacity": 4096}``).
        replicas: Ray Serve replicas (each a process with its own copy of the model).
        model_name: the name clients give as ``model`` (default: the file's stem).
        max_batch, solo_when_idle, calibrate, sessions, queue_size: per replica, as
            :func:`bitmtp.serve.create_app`'s; Ray sends a replica at most ``(max_batch or sessions) + queue_size``
            requests at once and queues the rest.
        ray_actor_options: Ray resources per replica (default ``{"num_cpus": 1}``).
        deployment_name: the deployment's name in Ray Serve.
        body_timeout: as :func:`bitmtp.serve.create_app`'s (seconds a request body may take to arrive).
        stream_interval: as :func:`bitmtp.serve.create_app`'s (least seconds between two streamed chunks).

    Returns:
        a ``ray.serve.Application``: ``serve.run(ray_app(...), route_prefix="/")`` serves it.
    """
    require_ray()
    from ray import serve

    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise BitMTPError(f"replicas: must be an integer >= 1, got {replicas!r}")
    for name, value, lo in (("sessions", sessions, 1), ("queue_size", queue_size, 0), ("max_batch", max_batch, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < lo:
            raise BitMTPError(f"{name}: must be an integer >= {lo}, got {value!r}")
    path = Path(model)
    if not path.exists():
        raise BitMTPError(f"model: {model} does not exist; give the path of a .gguf file or checkpoint folder")
    source, kwargs = str(path.resolve()), dict(load_kwargs or {})
    name = model_name or path.stem

    def build() -> Any:
        # runs in each replica: the model is loaded there, at the app's startup
        from bitmtp.serve.app import create_app

        def load() -> Any:
            import bitmtp

            return bitmtp.load(source, **kwargs)

        return create_app(load, model_name=name, sessions=sessions, queue_size=queue_size, replica_id=_replica_id,
                          body_timeout=body_timeout, stream_interval=stream_interval, max_batch=max_batch,
                          solo_when_idle=solo_when_idle, calibrate=calibrate)

    deployment = serve.deployment(serve.ingress(build)(), name=deployment_name, num_replicas=replicas,
                                  max_ongoing_requests=(max_batch or sessions) + queue_size,
                                  ray_actor_options=ray_actor_options or {"num_cpus": 1})
    return deployment.bind()
