"""The RBAC objects an operator run outside the chart authenticates as (the demo, the cluster tests):
exactly the chart's rules (charts/resilax/files/operator-rules.yaml), bound to a ServiceAccount."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

Manifest = dict[str, Any]


def build_operator_rbac(namespace: str, account: str, role: str,
                        rules: Sequence[Mapping[str, Any]]) -> tuple[Manifest, Manifest, Manifest]:
    """The ServiceAccount, ClusterRole (`rules`: charts/resilax/files/operator-rules.yaml) and
    ClusterRoleBinding an operator run outside the chart (the demo, the cluster tests) authenticates as."""
    account_body = {"apiVersion": "v1", "kind": "ServiceAccount",
                    "metadata": {"name": account, "namespace": namespace}}
    role_body = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                 "metadata": {"name": role}, "rules": [dict(rule) for rule in rules]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
               "metadata": {"name": role},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
               "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]}
    return account_body, role_body, binding
