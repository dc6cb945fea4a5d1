"""The retrieval service as a Ray Serve application: N replicas of the plain server's app behind one URL.

    python -m retriever.serve --ray --index_dir D [--replicas 2] [--address auto] [--port 8000] [server flags]
    python -m retriever.serve --index_dir D ...          # without --ray: exactly python -m retriever.server

Each replica runs the very application of ``retriever.server.create_app``: the same index loading
(``retriever.index.load_index``), the same ``MicroBatcher`` and the same HTTP schemas and limits (``POST /retrieve``,
``POST /queries``, ``GET /health``); Ray Serve's HTTP proxy (one per node, ``proxy_location="EveryNode"``) spreads
requests over the replicas and restarts a replica that dies (its in-flight requests fail with a 5xx and the
client's retries, ``openrlhf_search.env.retrieval_client.RetrievalClient``, send them again). Every response carries
``x-retriever-replica`` (Serve's replica id) and ``x-retriever-pid`` headers, so a client or a test can tell which
replica answered.

Ray: ``--address auto`` (or ``RAY_ADDRESS``) joins the running cluster, e.g. the training job's; without it a
local Ray is started (``--num_cpus``) and shut down on exit. On a cluster every replica loads ``--index_dir``,
which must be on a filesystem all nodes see (or the replicas are pinned to one node with ``--replica_resources``).
The command stays in the foreground and deletes the application on SIGTERM/SIGINT (exit status 0);
``--detach`` returns once the application is running and leaves it on the cluster (``serve shutdown`` or
``serve.delete(APP)`` removes it).

Every flag of ``python -m retriever.server`` (``--index_dir``, ``--host``, ``--port``, ``--port_file``, ``--topk``,
limits, batching, ``--device``, ``--nprobe`` ...) is accepted and means the same; ``--port 0`` picks a free port.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading

from .server import Limits, bind_socket
from .server import parse_args as parse_server_args

logger = logging.getLogger("retriever.serve")

DEFAULT_APP_NAME = "retriever"
DEPLOYMENT_NAME = "Retriever"


def _replica_app_builder(index_dir: str, limits: dict, batcher: dict, load_kwargs: dict):
    """A zero-argument function that Ray Serve calls inside each replica to build its ASGI app.

    It loads the index (``load_index(index_dir, **load_kwargs)``) and returns ``create_app(index, Limits(**limits),
    **batcher)`` plus a middleware naming the replica in the response headers. A closure (not a partial): Serve's
    ``ingress`` only calls plain functions.
    """

    def build():
        from ray import serve

        from .index import load_index
        from .server import create_app

        index = load_index(index_dir, **load_kwargs)
        app = create_app(index, Limits(**limits), **batcher)
        try:
            replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # pragma: no cover - outside a replica (a direct call in a test)
            replica = "local"
        pid = str(os.getpid())

        @app.middleware("http")
        async def name_replica(request, call_next):
            response = await call_next(request)
            response.headers["x-retriever-replica"] = replica
            response.headers["x-retriever-pid"] = pid
            return response

        return app

    return build


def build_application(index_dir: str, replicas: int = 1, limits: Limits | None = None, window_ms: float = 2.0,
                      max_batch_queries: int = 512, max_wait_ms: float = 50.0, load_kwargs: dict | None = None,
                      replica_cpus: float = 1.0, replica_gpus: float = 0.0, replica_resources: dict | None = None,
                      max_ongoing_requests: int = 256, health_check_period_s: float = 2.0, batching: bool = True):
    """The Ray Serve ``Application`` (not yet running) serving ``index_dir`` with ``replicas`` replicas.

    Args:
        index_dir: an index built by ``python -m retriever.build_index``, readable from every node that gets a
            replica. Checked here (its manifest) so a wrong path fails before anything is deployed.
        replicas: number of replicas (>= 1); each loads the whole index (a GPU-sharded faiss index loads onto the
            replica's GPUs: give ``replica_gpus``).
        limits, window_ms, max_batch_queries, max_wait_ms, batching: as ``retriever.server.create_app``
            (``batching=False``: ``--no_batching``, one search per request).
        load_kwargs: ``load_index`` options (``device``, ``faiss_gpu``, ``nprobe``, ``ef_search``).
        replica_cpus / replica_gpus / replica_resources: Ray resources each replica reserves.
        max_ongoing_requests: requests Serve lets into one replica at once. Serve's default (5) would starve
            the micro-batcher, which needs many concurrent requests to form batches.
    Raises:
        ValueError: replicas < 1, max_ongoing_requests < 1, negative resources.
        retriever.index.RetrieverIndexError: ``index_dir`` holds no complete index.
    """
    from ray import serve

    from .index import read_manifest

    if replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {replicas}")
    if max_ongoing_requests < 1:
        raise ValueError(f"max_ongoing_requests must be >= 1, got {max_ongoing_requests}")
    if replica_cpus < 0 or replica_gpus < 0:
        raise ValueError(f"replica resources must be >= 0, got cpus={replica_cpus} gpus={replica_gpus}")
    read_manifest(index_dir)  # RetrieverIndexError now rather than N replicas failing to start
    limits = limits or Limits()
    builder = _replica_app_builder(os.path.abspath(index_dir), dict(limits.__dict__),
                                   {"window_ms": window_ms, "max_batch_queries": max_batch_queries,
                                    "batching": batching, "max_wait_ms": max_wait_ms}, dict(load_kwargs or {}))
    actor_options = {"num_cpus": replica_cpus, "num_gpus": replica_gpus}
    if replica_resources:
        actor_options["resources"] = dict(replica_resources)
    deployment = serve.deployment(serve.ingress(builder)(), name=DEPLOYMENT_NAME, num_replicas=replicas,
                                  ray_actor_options=actor_options, max_ongoing_requests=max_ongoing_requests,
                                  health_check_period_s=health_check_period_s,
                                  # one log line per request per replica would flood the driver's console
                                  logging_config={"enable_access_log": False})
    return deployment.bind()


def deploy(app, host: str = "127.0.0.1", port: int = 8000, app_name: str = DEFAULT_APP_NAME) -> str:
    """Start Serve's HTTP proxies on ``host:port`` (if Serve is not running yet) and run ``app`` under
    ``app_name`` at route ``/``; returns once every replica is up. Needs ``ray.init`` done. Returns the URL.

    Raises ``RuntimeError`` (Serve's) when a replica cannot start, e.g. the index cannot be loaded there.
    """
    from ray import serve

    serve.start(http_options={"host": host, "port": port}, proxy_location="EveryNode")
    serve.run(app, name=app_name, route_prefix="/", blocking=False)
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    return f"http://{shown}:{port}"


def _free_port(host: str) -> int:
    sock = bind_socket(host, 0)
    port = sock.getsockname()[1]
    sock.close()
    return port


def parse_args(argv=None) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(Serve flags, server flags): the flags below, and everything else parsed by ``retriever.server``'s
    parser (which validates limits and exits with status 2 on a bad one)."""
    p = argparse.ArgumentParser(prog="python -m retriever.serve", description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ray", action="store_true", help="serve as a Ray Serve application (else: the plain server)")
    p.add_argument("--replicas", type=int, default=1, help="Serve replicas, each holding the whole index")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (auto, HOST:6379); default RAY_ADDRESS if set, else a local Ray")
    p.add_argument("--num_cpus", type=int, default=None, help="CPUs of a local Ray (no --address)")
    p.add_argument("--replica_cpus", type=float, default=1.0, help="CPUs reserved per replica")
    p.add_argument("--replica_gpus", type=float, default=0.0, help="GPUs per replica (dense index / encoder)")
    p.add_argument("--replica_resources", default=None,
                   help='custom Ray resources per replica as JSON, e.g. \'{"node:10.0.0.1": 0.01}\'')
    p.add_argument("--max_ongoing_requests", type=int, default=256, help="concurrent requests per replica")
    p.add_argument("--app_name", default=DEFAULT_APP_NAME, help="Serve application name")
    p.add_argument("--detach", action="store_true",
                   help="leave the application running on the cluster and exit (needs --address)")
    a, rest = p.parse_known_args(argv)
    if a.replicas < 1:
        p.error(f"--replicas must be >= 1, got {a.replicas}")
    if a.max_ongoing_requests < 1:
        p.error(f"--max_ongoing_requests must be >= 1, got {a.max_ongoing_requests}")
    if a.replica_cpus < 0 or a.replica_gpus < 0:
        p.error("--replica_cpus / --replica_gpus must be >= 0")
    if a.replica_resources is not None:
        try:
            a.replica_resources = json.loads(a.replica_resources)
        except ValueError as e:
            p.error(f"--replica_resources is not JSON: {e}")
        if not isinstance(a.replica_resources, dict):
            p.error("--replica_resources must be a JSON object")
    if a.address is None and os.environ.get("RAY_ADDRESS"):
        a.address = os.environ["RAY_ADDRESS"]
    if a.address and a.address.startswith(("http://", "https://")):
        # the dashboard / job-submission address (OpenRLHF's launchers export it): a driver on a cluster node
        # joins the cluster through its local raylet instead
        a.address = "auto"
    if a.detach and not a.address:
        p.error("--detach needs --address (a local Ray ends with this command)")
    if not a.ray and a.replicas != 1:
        p.error("--replicas needs --ray")
    a.server_argv = rest
    s = parse_server_args(rest)
    if a.ray and s.web:
        p.error("--ray serves an index; a web backend (--web) runs as one plain server (its limit is the "
                "provider's rate, not this process): drop --ray")
    return a, s


def main(argv=None) -> int:
    a, s = parse_args(argv)
    if not a.ray:
        from .server import main as server_main

        return server_main(a.server_argv)
    logging.basicConfig(level=s.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import ray
    from ray import serve

    from .index import RetrieverIndexError

    limits = Limits(max_query_chars=s.max_query_chars, max_queries=s.max_queries, max_topk=s.max_topk,
                    default_topk=s.topk)
    load_kwargs = {"device": s.device, "faiss_gpu": not s.no_faiss_gpu, "nprobe": s.nprobe, "ef_search": s.ef_search,
                   "dedup": s.dedup, "gpus": s.gpus, "faiss_temp_gb": s.faiss_temp_gb}
    try:
        app = build_application(s.index_dir, replicas=a.replicas, limits=limits, window_ms=s.batch_window_ms,
                                max_batch_queries=s.max_batch_queries, max_wait_ms=s.batch_max_wait_ms,
                                load_kwargs=load_kwargs, replica_cpus=a.replica_cpus, replica_gpus=a.replica_gpus,
                                replica_resources=a.replica_resources, max_ongoing_requests=a.max_ongoing_requests,
                                batching=not s.no_batching)
    except (RetrieverIndexError, ValueError) as e:
        print(f"retriever.serve: error: {e}", file=sys.stderr)
        return 2
    port = s.port if s.port else _free_port(s.host)
    local = not a.address
    ray.init(address=a.address, num_cpus=a.num_cpus if local else None, include_dashboard=False)
    stop = threading.Event()
    received: list[int] = []

    def _on_signal(sig, _frame):
        received.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    try:
        try:
            url = deploy(app, host=s.host, port=port, app_name=a.app_name)
        except Exception as e:  # Serve's deployment failure (a replica could not load the index, port taken)
            print(f"retriever.serve: error: the Serve application did not start: {e}", file=sys.stderr)
            return 2
        if s.port_file:
            tmp = s.port_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(str(port))
            os.replace(tmp, s.port_file)
        logger.info("serving %s with %d replica(s) on %s (application %r)", s.index_dir, a.replicas, url, a.app_name)
        print(f"retriever.serve: {url}", flush=True)
        if a.detach:
            return 0
        while not stop.wait(1.0):
            pass
        logger.info("stopping on %s", signal.Signals(received[0]).name if received else "exit")
        serve.delete(a.app_name)
        if local:
            serve.shutdown()
        return 0
    finally:
        ray.shutdown()  # a local Ray ends here; on a cluster only this driver disconnects


if __name__ == "__main__":
    sys.exit(main())
