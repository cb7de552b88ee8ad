"""Mutual TLS on both daemons: authorised nodes hand off KV; anyone else gets nothing."""
from __future__ import annotations

import random
import subprocess
from pathlib import Path

import grpc
import pytest

from common.serving.tls import TlsFiles
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc
from tests.helpers import started_pair
from tests.reference import FP32, engine_greedy

SAN = "subjectAltName=IP:127.0.0.1,DNS:localhost"


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


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    _ca(d, "ca")
    _ca(d, "rogue-ca")
    return {"node": _signed(d, "node", "ca"), "client": _signed(d, "client", "ca"),
            "rogue": _signed(d, "rogue", "rogue-ca"), "ca_only": TlsFiles(ca=d / "ca.pem")}


def test_mutual_tls_hand_off(certs, tmp_path, model):
    node = certs["node"]
    with started_pair(tmp_path, FP32, (*FP32, "--min-remote-prefill-tokens", "1"), tls=node) as (dn, pn):
        prompt = random.Random(1).choices(range(100, 40000), k=60)
        client = duet_pb2_grpc.DecodeNodeStub(certs["client"].channel(dn.address))
        request = pb.GenerateRequest(token_ids=prompt, sampling=pb.SamplingParams(max_tokens=6, ignore_eos=True))
        tokens = [t for c in client.Generate(request, timeout=120) for t in c.token_ids]
        assert tokens == engine_greedy(model, prompt, 6)
        assert pn.metrics()["duet_prefill_computed_tokens_total"] == 59  # the KV crossed over TLS peers

        ca = certs["node"].ca.read_bytes()
        without_client_cert = lambda a: grpc.secure_channel(a, grpc.ssl_channel_credentials(root_certificates=ca))
        for make_channel in (grpc.insecure_channel, without_client_cert, certs["rogue"].channel):
            decode = duet_pb2_grpc.DecodeNodeStub(make_channel(dn.address))
            prefill = duet_pb2_grpc.PrefillNodeStub(make_channel(pn.address))
            for call in (lambda: decode.GetTransportInfo(pb.GetTransportInfoRequest(), timeout=5),
                         lambda: decode.PrepareReceive(pb.PrepareReceiveRequest(request_id="x", token_ids=[1, 2]),
                                                       timeout=5),
                         lambda: prefill.RemoteSend(pb.RemoteSendRequest(request_id="x"), timeout=5)):
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        m = dn.metrics()
        assert m["duet_kv_pages_reserved"] == 0
