"""The node agent's control API (HTTP on 127.0.0.1; its port is in `<run_dir>/agent.json`): the
faults of node_faults.py, more nodes, the image registry table, and what the agent runs. The paths
are listed in agent.py's docstring; errors answer `{"error": {"code", "message"}}`."""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler
from typing import TYPE_CHECKING, Any

from . import node_faults
from .profiles import NodeSpec

if TYPE_CHECKING:
    from .agent import NodeAgent

log = logging.getLogger(__name__)


def build_handler(agent: NodeAgent) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            log.debug("control: " + format, *args)

        def _answer(self, code: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self._answer(200, {"registered": agent.registered.is_set()})
            elif self.path == "/nodes":
                self._answer(200, {"nodes": agent.describe_nodes()})
            elif self.path == "/pods":
                self._answer(200, {"pods": agent.describe_pods()})
            elif self.path == "/images":
                self._answer(200, agent.describe_images())
            else:
                self._answer(404, {"error": {"code": 404, "message": f"no such path {self.path}"}})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}") if length else {}
            parts = [p for p in self.path.split("/") if p]
            try:
                if parts == ["nodes"]:
                    result = agent.add_nodes([NodeSpec.from_json(n) for n in body.get("nodes", [])])
                elif parts == ["images"]:
                    result = agent.set_images(list(body.get("images", [])))
                elif len(parts) == 3 and parts[0] == "nodes":
                    name, action = parts[1], parts[2]
                    actions = {
                        "kill": lambda: node_faults.kill_node(agent, name),
                        "partition": lambda: node_faults.partition_node(agent, name),
                        "restore": lambda: node_faults.restore_node(agent, name),
                        "unhealthy": lambda: node_faults.make_node_unhealthy(agent, name,
                                                                             str(body.get("part", "matmul"))),
                        "remove": lambda: agent.remove_node(name),
                        "preempt": lambda: node_faults.preempt_node(agent, name, float(body.get("delay_seconds", 30)),
                                                                    bool(body.get("sigterm", False))),
                        "shutdown": lambda: node_faults.shutdown_node(
                            agent, name, float(body.get("grace_seconds", 30)),
                            float(body.get("critical_grace_seconds", 15))),
                    }
                    if action not in actions:
                        raise KeyError(f"unknown action {action!r}; valid: {', '.join(actions)}")
                    result = actions[action]()
                else:
                    raise KeyError(f"no such path {self.path}")
            except KeyError as e:
                self._answer(404, {"error": {"code": 404, "message": str(e.args[0])}})
                return
            except ValueError as e:
                self._answer(409, {"error": {"code": 409, "message": str(e)}})
                return
            except Exception as e:
                log.exception("control %s", self.path)
                self._answer(500, {"error": {"code": 500, "message": str(e)}})
                return
            self._answer(200, result)

    return Handler
