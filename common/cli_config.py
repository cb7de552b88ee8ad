"""CLI flags with an optional JSON config file: values from `--config FILE` become the
parser's defaults, so flags given on the command line still win."""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def parse_with_config_file(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    parser.add_argument("--config", type=Path, help="JSON file of flag values (keys as flag names, '-' or '_')")
    known, _ = parser.parse_known_args(argv)
    if known.config is not None:
        try:
            values = json.loads(known.config.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            parser.error(f"cannot read config file {known.config}: {exc}")
        if not isinstance(values, dict):
            parser.error(f"config file {known.config} must hold a JSON object")
        dests = {a.dest for a in parser._actions}
        defaults = {}
        for key, value in values.items():
            dest = key.lstrip("-").replace("-", "_")
            if dest not in dests:
                parser.error(f"config file {known.config}: unknown setting {key!r}")
            defaults[dest] = value
        parser.set_defaults(**defaults)
    return parser.parse_args(argv)
