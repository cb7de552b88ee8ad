"""Certificates for TLS tests, made with the openssl command: a CA, node and client
certificates it signed (for 127.0.0.1 and localhost), and a rogue CA's certificate."""
from __future__ import annotations

import subprocess
from pathlib import Path

from common.serving.tls import TlsFiles

SAN = "subjectAltName=IP:127.0.0.1,DNS:localhost"


def issue_certificates(d: Path) -> dict[str, TlsFiles]:
    """In `d`: "node" and "client" signed by one CA, "rogue" by another, "ca_only" the CA alone."""
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    return {"node": _signed(d, "node", "ca"), "client": _signed(d, "client", "ca"),
            "rogue": _signed(d, "rogue", "rogue-ca"), "ca_only": TlsFiles(ca=d / "ca.pem")}


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "1", "-subj", f"/CN={name}", cwd=d)


def _signed(d: Path, name: str, ca: str) -> TlsFiles:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout",
             f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(SAN + "\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-out", f"{name}.pem", "-days", "1", "-extfile", f"{name}.ext", cwd=d)
    return TlsFiles(d / f"{name}.pem", d / f"{name}.key", d / "ca.pem")
