"""What makes an object a job's own (pure): the JAXJob controlling it by its owner reference, not a
name or a label anybody can give (docs/jaxjob-reference.md, "Ownership"). The worker pods, the
headless Services and the token Secret are matched by it (`observed.assemble_observed`, k8s.py's
`create_owned` and `ensure_token_secret`); policies/name_conflict.py says what a conflict does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from . import api


def owner_uid(raw: Mapping[str, Any]) -> str:
    """uid of the JAXJob controlling an object (its ownerReference with controller: true and kind JAXJob of
    our group); "" when none does. What makes a pod, a Service or the token Secret a job's own: the job's
    name in a label or in the object's name can be anybody's (docs/jaxjob-reference.md, "Ownership")."""
    for ref in (raw.get("metadata") or {}).get("ownerReferences") or []:
        if isinstance(ref, Mapping) and ref.get("controller") and ref.get("kind") == api.KIND \
                and str(ref.get("apiVersion", "")).split("/")[0] == api.GROUP:
            return str(ref.get("uid") or "")
    return ""


def describe_owner(raw: Mapping[str, Any]) -> str:
    """Who owns an object, for a message: its controller ownerReference, or "no owner"."""
    refs = [r for r in (raw.get("metadata") or {}).get("ownerReferences") or [] if isinstance(r, Mapping)]
    ref = next((r for r in refs if r.get("controller")), refs[0] if refs else None)
    if ref is None:
        return "no owner"
    return f"owned by {ref.get('kind', '?')} {ref.get('name', '?')} (uid {ref.get('uid', '?')})"
