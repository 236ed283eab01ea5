"""Merge the replicas' /metrics, /api/ps and /health answers into the ingress's one answer."""

from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(.*)$")


def merge_metrics(texts: dict[str, str]) -> str:
    """Prometheus text of every replica, each sample labelled `replica="ID"`; a family's HELP/TYPE once, its
    samples from every replica together (the text format wants a family's samples in one group)."""
    families: dict[str, list[str]] = {}  # family name -> its HELP/TYPE lines, then samples
    order: list[str] = []
    for rid, text in texts.items():
        family = ""
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                family = line.split()[2]
                if family not in families:
                    families[family] = []
                    order.append(family)
                if line not in families[family]:
                    families[family].append(line)
                continue
            m = _SAMPLE.match(line)
            if not m:
                continue
            name, labels, value = m.groups()
            inner = labels[1:-1] if labels else ""
            labelled = f'{name}{{replica="{rid}"{"," + inner if inner else ""}}} {value}'
            families.setdefault(family or name, []).append(labelled)
            if (family or name) not in order:
                order.append(family or name)
    return "".join(line + "\n" for f in order for line in families[f])


def merge_ps(answers: dict[str, dict]) -> dict:
    """/api/ps of the cluster: every replica's models, each with the `replica` that holds it."""
    return {"models": [{**m, "replica": rid} for rid, a in answers.items() for m in a.get("models", [])]}


def merge_health(answers: dict[str, dict | None]) -> tuple[int, dict]:
    """/health of the cluster: 200 while any replica answers; each model's best state over the replicas, and each
    replica's own answer (None: it did not answer)."""
    rank = {"loaded": 2, "loading": 1, "not loaded": 0}
    models: dict[str, str] = {}
    for a in answers.values():
        for mid, state in (a or {}).get("models", {}).items():
            if rank.get(state, 0) >= rank.get(models.get(mid, ""), -1):
                models[mid] = state
    ok = any(a is not None for a in answers.values())
    body = {"status": "ok" if ok else "unavailable", "loading": any(s == "loading" for s in models.values()),
            "models": models, "replicas": answers}
    return (200 if ok else 503), body
