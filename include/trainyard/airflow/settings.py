"""Load ``airflow_settings.yaml`` (Astro CLI format) into the metadata DB.

``python -m trainyard.airflow.settings FILE``: upserts connections, pools and
variables, so running it twice changes nothing. Credentials are never printed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import yaml


def load_settings(path: Path) -> dict[str, list[dict[str, Any]]]:
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    section = data.get("airflow") or {}
    settings = {key: list(section.get(key) or []) for key in ("connections", "pools", "variables")}
    for i, c in enumerate(settings["connections"]):
        # The metadata DB refuses a connection without a type, with a traceback that names neither.
        if not (isinstance(c.get("conn_type"), str) and c["conn_type"]):
            raise ValueError(
                f"{path}: airflow.connections[{i}] ({c.get('conn_id')}): conn_type is missing;"
                " set it (aws, kubernetes, smtp, ...)"
            )
    return settings


def apply(settings: dict[str, list[dict[str, Any]]]) -> list[str]:
    from airflow.models import Connection, Pool, Variable
    from airflow.utils.session import create_session

    done = []
    with create_session() as session:
        for c in settings["connections"]:
            conn = session.query(Connection).filter(Connection.conn_id == c["conn_id"]).one_or_none()
            conn = conn or Connection(conn_id=c["conn_id"])
            conn.conn_type = c["conn_type"]
            conn.description = c.get("conn_description")
            conn.host, conn.schema = c.get("conn_host"), c.get("conn_schema")
            conn.login, conn.port = c.get("conn_login"), c.get("conn_port")
            if c.get("conn_password"):
                conn.set_password(c["conn_password"])
            extra = c.get("conn_extra")
            conn.set_extra(json.dumps(extra) if isinstance(extra, dict) else extra)
            session.add(conn)
            done.append(f"connection {c['conn_id']}")
        for p in settings["pools"]:
            # include_deferred: a deferred task whose pods still run must keep its slots (Astro has no such key).
            Pool.create_or_update_pool(
                p["pool_name"],
                int(p["pool_slot"]),
                p.get("pool_description", ""),
                include_deferred=bool(p.get("pool_include_deferred", False)),
                session=session,
            )
            done.append(f"pool {p['pool_name']} ({p['pool_slot']} slots)")
    for v in settings["variables"]:
        Variable.set(v["variable_name"], v["variable_value"])
        done.append(f"variable {v['variable_name']}")
    return done


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0] if args else "airflow_settings.yaml")
    try:
        settings = load_settings(path)
    except ValueError as exc:
        print(exc, file=sys.stderr)
        return 2
    for line in apply(settings):
        print(f"loaded {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
