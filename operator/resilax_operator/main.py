"""`resilax operator`: run the JAXJob operator (kopf) with its settings, peering and metrics endpoint.

    resilax operator --namespace team-a [--namespace team-b] | --all-namespaces
                     [--peering NAME | --standalone] [--kubeconfig PATH]
                     [--metrics-bind-address HOST:PORT] [--liveness URL]

Settings come from `RESILAX_OPERATOR_*` (settings.OperatorSettings.from_env). Logging is configured
here and nowhere else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import random
import sys
from collections.abc import Sequence

from .settings import OperatorSettings


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="resilax operator", description="Run the JAXJob operator.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[],
                       help="watch this namespace (repeatable); default: all namespaces")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    peering = p.add_mutually_exclusive_group()
    peering.add_argument("--peering", metavar="NAME",
                         help="kopf peering object (KopfPeering per namespace, or ClusterKopfPeering): two "
                              "operators never act at once")
    peering.add_argument("--standalone", action="store_true", help="run without peering (the default)")
    p.add_argument("--priority", type=int, default=None,
                   help="peering priority; default: random, so that one of several replicas runs and the others pause")
    p.add_argument("--peering-lifetime", type=int, default=60,
                   help="seconds after which a silent peer counts as gone (a killed operator's successor waits that long)")
    p.add_argument("--kubeconfig", help="kubeconfig file; default: in-cluster, then $KUBECONFIG / ~/.kube/config")
    p.add_argument("--metrics-bind-address", default="",
                   help="HOST:PORT of the Prometheus endpoint (/metrics); empty: none")
    p.add_argument("--liveness", default=None, help="kopf liveness endpoint URL, e.g. http://0.0.0.0:8080/healthz")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", default="text", choices=["json", "text"],
                   help="json: kopf's JSON lines (one object per line, with `severity` and the job as `object`; "
                        "the chart's default) or text")
    return p


class _Severity(logging.Filter):
    """`severity` as Cloud Logging's LogSeverity names (the level's name: INFO, WARNING, ERROR, ...);
    kopf's JSON formatter would write its own lower-case `warn` and `fatal` otherwise."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.severity = record.levelname
        return True


def configure_logging(level: str, log_format: str) -> None:
    """The operator's log lines on stderr. json: kopf's JSON formatter (the job's reference as `object`
    in the lines about a job), with Cloud Logging's severity names; text: one plain line per record."""
    if log_format != "json":
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return
    import kopf

    kopf.configure(log_format=kopf.LogFormat.JSON, log_refkey="object")
    root = logging.getLogger()
    root.setLevel(level)
    for handler in root.handlers:
        handler.addFilter(_Severity())


class _QuietHandlerSuccess(logging.Filter):
    """Drop kopf's "Handler 'pod-event' succeeded." lines: the wake-up handlers run on every event."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (message.startswith("Handler '") and message.endswith("' succeeded."))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.kubeconfig:
        # Before kubernetes/kopf are imported: both read $KUBECONFIG (kopf's login handler too).
        os.environ["KUBECONFIG"] = args.kubeconfig
    configure_logging(args.log_level, args.log_format)
    logging.getLogger("kubernetes").setLevel(logging.WARNING)
    logging.getLogger("urllib3").setLevel(logging.WARNING)
    logging.getLogger("kopf.objects").addFilter(_QuietHandlerSuccess())
    log = logging.getLogger("resilax_operator")
    import kopf

    from . import handlers, k8s

    try:
        settings = OperatorSettings.from_env()
    except (TypeError, ValueError) as e:
        print(f"resilax operator: bad RESILAX_OPERATOR_* setting: {e}", file=sys.stderr)
        return 2
    kube = k8s.Kube(k8s.load_api_client(args.kubeconfig))
    if args.metrics_bind_address:
        from prometheus_client import start_http_server

        host, _, port = args.metrics_bind_address.rpartition(":")
        start_http_server(int(port), addr=host or "0.0.0.0")
        log.info("metrics on http://%s/metrics", args.metrics_bind_address)

    memo = kopf.Memo(kube=kube, settings=settings, peering_lifetime=args.peering_lifetime,
                     namespaces=tuple(args.namespace), wakeups={})
    priority = args.priority if args.priority is not None else random.randint(1, 1_000_000)
    log.info("starting: %s, %s (priority %d)",
             f"namespaces {', '.join(args.namespace)}" if args.namespace else "all namespaces",
             f"peering {args.peering}" if args.peering else "standalone", priority)
    assert handlers.FINALIZER  # the handlers register themselves on import
    with contextlib.suppress(KeyboardInterrupt, asyncio.CancelledError):
        kopf.run(clusterwide=not args.namespace, namespaces=args.namespace,
                 standalone=not args.peering, peering_name=args.peering, priority=priority,
                 liveness_endpoint=args.liveness, memo=memo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
