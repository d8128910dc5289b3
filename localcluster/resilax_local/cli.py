"""`resilax local ...`: build the binaries, start and stop a local cluster, break its nodes.

    resilax local binaries [--skip-kueue | --kueue-only]   # find or build; print the paths
    resilax local up [--profile default] [--dir DIR] [--name NAME] [--kueue]
    resilax local status | nodes | down
    resilax local logs NAMESPACE/POD [CONTAINER] [--previous]
    resilax local kill-node NODE | partition-node NODE | restore-node NODE
    resilax local preempt-node NODE [--delay 30] [--sigterm]
    resilax local shutdown-node NODE [--grace 30] [--critical-grace 15]
    resilax local unhealthy-node NODE [--part matmul]  # Ready, but its containers fail `resilax health-check`
    resilax local add-nodes --slice POOL [--accelerator A] [--topology T] | --cpu NAME [--no-processes]
    resilax local images                        # the registry table
    resilax local set-image IMAGE [--unpullable [--error TEXT]] [--user USER]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from . import binaries
from .errors import LocalClusterError
from .node.profiles import PROFILES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="resilax local", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    def with_dir(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--dir", type=Path, help="run folder (default ~/.cache/resilax/clusters/NAME)")
        p.add_argument("--name", default="default", help="cluster name, for the default run folder")
        return p

    b = sub.add_parser("binaries", help="find or build kube-apiserver, controller manager, scheduler, etcd, "
                       "fake-gcs-server, Kueue")
    b.add_argument("--no-build", action="store_true", help="fail instead of building what is missing")
    b.add_argument("--kwok", action="store_true", help="also build kwok")
    only = b.add_mutually_exclusive_group()
    only.add_argument("--skip-kueue", action="store_true", help="everything but Kueue (its e2e builds it on first use)")
    only.add_argument("--kueue-only", action="store_true", help="only Kueue (scripts/test builds it in the "
                      "background at low priority while the rest runs)")
    up = with_dir(sub.add_parser("up", help="start a cluster and return once its nodes are Ready"))
    up.add_argument("--profile", default="default", choices=PROFILES)
    up.add_argument("--node-monitor-grace", type=int, default=16, help="seconds before a silent node goes Unknown")
    up.add_argument("--kueue", action="store_true", help="also run Kueue (pod integration) with a ClusterQueue "
                    "and a LocalQueue `resilax-local` in namespace default (docs/local-cluster.md, Kueue)")
    with_dir(sub.add_parser("down", help="stop the cluster; no process is left"))
    with_dir(sub.add_parser("status", help="processes, nodes, kubeconfig"))
    with_dir(sub.add_parser("nodes", help="the node agent's nodes and their states"))
    with_dir(sub.add_parser("pods", help="the pods the node agent runs, with their processes"))
    logs = with_dir(sub.add_parser("logs", help="a container's log"))
    logs.add_argument("pod", help="NAMESPACE/POD")
    logs.add_argument("container", nargs="?")
    logs.add_argument("--previous", "-p", action="store_true")
    for name, help_ in (("kill-node", "hard node loss: Lease stops, processes SIGKILLed"),
                        ("partition-node", "Lease and API traffic stop, processes keep running"),
                        ("restore-node", "bring a node back"), ("remove-node", "kill and delete a node")):
        with_dir(sub.add_parser(name, help=help_)).add_argument("node")
    pre = with_dir(sub.add_parser("preempt-node", help="GKE preemption notice, then kill after a delay"))
    pre.add_argument("node")
    pre.add_argument("--delay", type=float, default=30.0, help="seconds from the notice to the kill")
    pre.add_argument("--sigterm", action="store_true", help="also SIGTERM the main containers now")
    down = with_dir(sub.add_parser("shutdown-node", help="graceful node shutdown (a spot VM's): no notice, "
                                   "NotReady, pods SIGTERMed within the grace, then the node powers off"))
    down.add_argument("node")
    down.add_argument("--grace", type=float, default=30.0, help="the kubelet's shutdownGracePeriod (seconds)")
    down.add_argument("--critical-grace", type=float, default=15.0,
                      help="its shutdownGracePeriodCriticalPods: the part kept for system-critical pods")
    sick = with_dir(sub.add_parser("unhealthy-node", help="the node stays Ready, but the containers it starts "
                                   "fail a part of `resilax health-check` (restore-node heals it)"))
    sick.add_argument("node")
    sick.add_argument("--part", default="matmul", choices=("devices", "matmul", "collective", "hang"),
                      help="the part its containers fail (RESILAX_HEALTH_FAULT)")
    add = with_dir(sub.add_parser("add-nodes", help="register more nodes"))
    group = add.add_mutually_exclusive_group(required=True)
    group.add_argument("--slice", metavar="POOL", help="a TPU slice (node pool) named POOL")
    group.add_argument("--cpu", metavar="NAME", help="a CPU node named NAME")
    add.add_argument("--accelerator", default="tpu-v5-lite-podslice")
    add.add_argument("--topology", default="2x4")
    add.add_argument("--no-processes", action="store_true", help="fake the pods (scale tests)")
    with_dir(sub.add_parser("images", help="the node agent's image registry table"))
    image = with_dir(sub.add_parser("set-image", help="add or replace a row of the image registry table "
                                    "(docs/local-cluster.md, Images and waiting states)"))
    image.add_argument("image", help="repo[:tag]; a repository without a tag means every tag")
    image.add_argument("--unpullable", action="store_true", help="the registry does not have it: ErrImagePull")
    image.add_argument("--error", default="", help="the pull error's text (with --unpullable)")
    image.add_argument("--user", default="65532", help="the image's USER (0: root)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        return _run(args)
    except (LocalClusterError, KeyError, ValueError, FileNotFoundError) as e:
        print(f"resilax local {args.command}: {e}", file=sys.stderr)
        return 1


def _print(obj: object) -> None:
    print(json.dumps(obj, indent=2))


def _run(args: argparse.Namespace) -> int:
    from .cluster import LocalCluster

    if args.command == "binaries":
        paths: dict[str, str] = {}
        if not args.kueue_only:
            paths.update(binaries.ensure_binaries(build=not args.no_build).as_dict())
            paths["fake-gcs-server"] = str(binaries.ensure_fake_gcs_server(build=not args.no_build))
        if not args.skip_kueue:
            paths["kueue"] = str(binaries.ensure_kueue(build=not args.no_build).manager)
        if args.kwok:
            paths["kwok"] = str(binaries.ensure_kwok())
        for name, path in paths.items():
            print(f"{name}: {path}")
        return 0
    if args.command == "up":
        from .controlplane.plane import ControlPlaneSettings
        from .launch import isolation_problem

        cluster = LocalCluster(args.dir, name=args.name, profile=args.profile,
                               settings=ControlPlaneSettings(node_monitor_grace_seconds=args.node_monitor_grace),
                               kueue=args.kueue)
        cluster.check_run_dir()  # a folder it must not wipe: said first, whoever runs it
        problem = isolation_problem()
        if problem is not None:
            print(f"resilax local up: {problem}", file=sys.stderr)
            return 1
        cluster.start()
        print(f"local cluster up in {cluster._state['startup_seconds']} s ({cluster.run_dir})")
        kueue = cluster.kueue_state()
        if kueue is not None:
            print(f"Kueue {kueue.version} runs (pod integration): label a JAXJob "
                  "kueue.x-k8s.io/queue-name=resilax-local in namespace default")
        print(f"export KUBECONFIG={cluster.kubeconfig}")
        return 0
    if args.command == "down":
        from .cluster import default_run_dir

        run_dir = args.dir or default_run_dir(args.name)
        LocalCluster.stop_dir(run_dir)
        print(f"local cluster in {run_dir} stopped")
        return 0
    cluster = LocalCluster.attach(args.dir, args.name)
    if args.command == "status":
        _print(cluster.status())
    elif args.command == "nodes":
        for n in cluster.nodes():
            print(f"{n['name']:<24} {n['state']:<12} {n['ip']:<16} pods={n['pods']}"
                  + ("" if n["run_pods"] else " (no processes)"))
    elif args.command == "pods":
        _print(cluster.pods())
    elif args.command == "logs":
        namespace, _, pod = args.pod.rpartition("/")
        sys.stdout.write(cluster.logs(namespace or "default", pod, args.container, args.previous))
    elif args.command == "kill-node":
        _print(cluster.kill_node(args.node))
    elif args.command == "partition-node":
        _print(cluster.partition_node(args.node))
    elif args.command == "restore-node":
        _print(cluster.restore_node(args.node))
    elif args.command == "remove-node":
        _print(cluster.remove_node(args.node))
    elif args.command == "preempt-node":
        _print(cluster.preempt_node(args.node, args.delay, args.sigterm))
    elif args.command == "shutdown-node":
        _print(cluster.shutdown_node(args.node, args.grace, args.critical_grace))
    elif args.command == "unhealthy-node":
        _print(cluster.make_node_unhealthy(args.node, args.part))
    elif args.command == "images":
        _print(cluster.images())
    elif args.command == "set-image":
        _print(cluster.set_images([{"image": args.image, "pullable": not args.unpullable, "error": args.error,
                                    "user": args.user}]))
    elif args.command == "add-nodes":
        if args.slice:
            added = cluster.add_tpu_slice(args.slice, args.accelerator, args.topology, not args.no_processes)
        else:
            added = cluster.add_cpu_node(args.cpu, not args.no_processes)
        _print({"added": added})
    return 0
