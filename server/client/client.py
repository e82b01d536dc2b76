"""A small gRPC client for a k3serve (or any SglangScheduler) server.

``Client(target).generate(ids, ...)`` streams token-id deltas and ends with the
``GenerateComplete``; ``Client.tokenizer()`` fetches the server's tokenizer bundle
(``GetTokenizer``) into a temporary folder and loads it, so a client needs no local files.
"""
from __future__ import annotations

import hashlib
import io
import tempfile
import uuid
import zipfile
from pathlib import Path
from typing import Iterator

import grpc
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pb_grpc


class Client:
    def __init__(self, target: str = "127.0.0.1:50051", *, api_key: str | None = None, tls_ca: str | None = None):
        if tls_ca:
            creds = grpc.ssl_channel_credentials(Path(tls_ca).read_bytes())
            self.channel = grpc.secure_channel(target, creds)
        else:
            self.channel = grpc.insecure_channel(target)
        self.stub = pb_grpc.SglangSchedulerStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._tok_dir = None

    def close(self) -> None:
        self.channel.close()
        if self._tok_dir is not None:
            self._tok_dir.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def model_info(self, timeout: float = 30):
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata, timeout=timeout)

    def generate(self, ids, *, max_new_tokens: int | None = None, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = -1, stop_token_ids=(), stop=(), ignore_eos: bool = False, stream: bool = True,
                 request_id: str | None = None, timeout: float | None = 600) -> Iterator["pb.GenerateResponse"]:
        sp = pb.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, stop_token_ids=list(stop_token_ids),
                               stop=list(stop), ignore_eos=ignore_eos, repetition_penalty=1.0)
        if max_new_tokens is not None:
            sp.max_new_tokens = max_new_tokens
        req = pb.GenerateRequest(request_id=request_id or f"cli-{uuid.uuid4().hex[:12]}",
                                 tokenized=pb.TokenizedInput(input_ids=list(ids)), sampling_params=sp, stream=stream)
        return self.stub.Generate(req, metadata=self.metadata, timeout=timeout)

    def tokenizer(self, timeout: float = 60):
        """The server's tokenizer (None if it ships none)."""
        from ..text.tokenizer import load_tokenizer

        data, digest = b"", ""
        for chunk in self.stub.GetTokenizer(common_pb2.GetTokenizerRequest(), metadata=self.metadata,
                                            timeout=timeout):
            data += chunk.data
            digest = chunk.sha256 or digest
        if digest and hashlib.sha256(data).hexdigest() != digest:
            raise ValueError("tokenizer bundle checksum mismatch")
        self._tok_dir = tempfile.TemporaryDirectory(prefix="k3serve-tok-")
        with zipfile.ZipFile(io.BytesIO(data)) as z:
            z.extractall(self._tok_dir.name)
        return load_tokenizer(self._tok_dir.name)
