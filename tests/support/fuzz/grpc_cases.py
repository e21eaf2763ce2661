"""gRPC fuzzing of every RPC of the gateway, the verifier and the drafter.

Every case is sent as bytes through a generic `channel.unary_unary` / `unary_stream` (no serializer), so the
same path carries typed mutations of valid messages (fields out of range, NaN / inf, odd strings, repeated
fields up to a size bound, contradictory options) and raw-byte mutations of their serialized form (random
bytes, flips, truncations, lying length prefixes, wrong wire types, nested groups, concatenations). Streams
are read for two messages at most, then cancelled. UNKNOWN, or INTERNAL from project code, is a failure;
grpcio's own INTERNAL for bytes that do not parse ("Exception deserializing request!") is counted apart.
"""

from __future__ import annotations

import concurrent.futures as cf
import math
import random

import grpc

from ddtree.protocol.ddtree.v1 import common_pb2, drafter_pb2, gateway_pb2, gateway_pb2_grpc, verifier_pb2
from tests.support.fuzz.common import GRPC_DESERIALIZE_ERROR, FuzzStack, Report
from tests.support.fuzz.http_cases import SPECIAL_TOKENS, odd_text

STREAMS = {"ddtree.v1.Gateway/Chat", "ddtree.v1.Gateway/Complete", "ddtree.v1.Verifier/Generate"}
INT32 = [-(2**31), -1, 0, 1, 7, 2**31 - 1]
FLOATS = [math.nan, math.inf, -math.inf, -1.0, -0.0, 0.0, 0.5, 1.0, 1.5, 2.0, 3.4e38, 1e-45]


def text(rng: random.Random, big: int) -> str:
    """A proto-safe odd string (no lone surrogates: those cannot be serialized at all)."""
    return rng.choice([
        lambda: "", lambda: "x", lambda: "hi", lambda: "x" * rng.randint(1, big), lambda: "\x00" * 50,
        lambda: "".join(c for c in odd_text(rng, rng.randint(1, 300)) if not 0xD800 <= ord(c) <= 0xDFFF),
        lambda: "".join(rng.choice(SPECIAL_TOKENS) for _ in range(rng.randint(1, 50))),
        lambda: "<|im_end|><|im_assistant|>",
    ])()  # fmt: skip


def json_text(rng: random.Random) -> str:
    return rng.choice([
        "", "{}", "[]", "null", "1", '"x"', "{", "[" * 70 + "]" * 70, "[" * 5000, '{"a": NaN}', "1" * 200, "1e400",
        '{"thinking": "yes"}', '{"thinking": false}', '[{"type": "function", "function": {"name": "f"}}]',
        '[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]', '[{"x": 1}]',
    ])  # fmt: skip


def options(rng: random.Random, o: gateway_pb2.GenerationOptions, big: int) -> None:
    for _ in range(rng.randint(1, 4)):
        field = rng.choice(["max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                            "ignore_eos", "no_spec", "budget", "prompt_logprobs"])  # fmt: skip
        if field == "max_tokens":
            o.max_tokens = rng.choice([-5, 0, 1, 4, 2048, 4096, 4097, 2**31 - 1, -(2**31)])
        elif field in ("temperature", "top_p"):
            setattr(o, field, rng.choice(FLOATS))
        elif field in ("top_k", "budget"):
            setattr(o, field, rng.choice([*INT32, 1024, 1025]))
        elif field == "prompt_logprobs":
            o.prompt_logprobs = rng.choice([*INT32, 20, 21])
        elif field == "seed":
            o.seed = rng.choice([0, 1, 2**64 - 1])
        elif field == "stop":
            o.stop.extend(text(rng, 200) for _ in range(rng.choice([1, 3, 500])))
        elif field == "stop_token_ids":
            o.stop_token_ids.extend(rng.choice(INT32 + [8191, 8192, 10**6]) for _ in range(rng.choice([1, 4, 3000])))
        else:
            setattr(o, field, rng.random() < 0.5)


def chat(rng, ctx, big):
    msgs = []
    for _ in range(rng.choice([0, 1, 1, 2, 5, 300])):
        m = gateway_pb2.ChatMessage(role=rng.choice(["user", "assistant", "system", "tool", "", "x", "<|im_user|>"]),
                                    content=text(rng, big))  # fmt: skip
        if rng.random() < 0.2:
            m.name, m.tool_call_id, m.reasoning_content = text(rng, 50), text(rng, 50), text(rng, big)
        if rng.random() < 0.2:
            m.tool_calls.add(id=text(rng, 20), name=text(rng, 20), arguments=json_text(rng))
        msgs.append(m)
    req = gateway_pb2.ChatRequest(messages=msgs, options=gateway_pb2.GenerationOptions(max_tokens=4))
    if rng.random() < 0.6:
        options(rng, req.options, big)
    if rng.random() < 0.3:
        req.tools_json = json_text(rng)
    if rng.random() < 0.3:
        req.chat_template_kwargs_json = json_text(rng)
    if rng.random() < 0.2:
        req.request_id = rng.choice(["fuzz-dup", text(rng, 400)])
    return req


def complete(rng, ctx, big):
    req = gateway_pb2.CompleteRequest(prompt=text(rng, big), options=gateway_pb2.GenerationOptions(max_tokens=4))
    options(rng, req.options, big)
    if rng.random() < 0.2:
        req.request_id = rng.choice(["fuzz-dup", text(rng, 400)])
    return req


def tokenize(rng, ctx, big):
    req = gateway_pb2.TokenizeRequest(text=text(rng, big), add_generation_prompt=rng.random() < 0.5)
    if rng.random() < 0.4:
        req.messages.extend(chat(rng, ctx, big).messages)
    return req


def generate(rng, ctx, big):
    vocab = ctx["vocab"]
    req = verifier_pb2.GenerateRequest(input_ids=[5, 6, 7], max_new_tokens=4)
    for _ in range(rng.randint(1, 4)):
        field = rng.choice(["input_ids", "sampling", "max_new_tokens", "stop_token_ids", "spec", "request_id",
                            "prompt_logprobs"])  # fmt: skip
        if field == "input_ids":
            del req.input_ids[:]
            n = rng.choice([0, 1, 50, 2047, 2048, 2049, 5000])
            req.input_ids.extend(rng.choice([rng.randrange(vocab), vocab, -1, 2**31 - 1]) if rng.random() < 0.1
                                 else rng.randrange(vocab) for _ in range(n))  # fmt: skip
        elif field == "sampling":
            req.sampling.temperature, req.sampling.top_p = rng.choice(FLOATS), rng.choice(FLOATS)
            req.sampling.top_k = rng.choice(INT32)
            if rng.random() < 0.5:
                req.sampling.seed = rng.choice([0, 2**64 - 1])
        elif field == "max_new_tokens":
            req.max_new_tokens = rng.choice([*INT32, 4096, 4097])
        elif field == "stop_token_ids":
            req.stop_token_ids.extend(rng.choice([*INT32, vocab]) for _ in range(rng.choice([1, 1000])))
        elif field == "spec":
            req.spec.CopyFrom(common_pb2.SpecOptions(no_spec=rng.random() < 0.3, chain=rng.random() < 0.3,
                                                     budget=rng.choice([*INT32, 1024, 1025])))  # fmt: skip
        elif field == "prompt_logprobs":
            req.prompt_logprobs = rng.choice([*INT32, 20, 21])
        else:
            req.request_id = rng.choice(["", "fuzz-dup", "x" * 257, text(rng, 300)])
    return req


def abort(rng, ctx, big):
    return verifier_pb2.AbortRequest(request_id=rng.choice(["", "fuzz-dup", "x" * 257, "x" * 20000, text(rng, 300)]))


def draft(rng, ctx, big):
    width, vocab = ctx["width"], ctx["vocab"]
    seqs = []
    count = rng.choice([1, 1, 2, 8, 40])
    for _ in range(count):
        n = rng.choice([0, 1, 2, 17, 300] if count < 8 else [0, 1, 2, 17])  # features stay under ~2 MB a call
        seq_id = rng.choice([f"fuzz-{rng.randrange(10**6)}", "fuzz-fixed", "", "x" * 257, text(rng, 40)])
        s = drafter_pb2.SeqDraft(seq_id=seq_id, commit_token_ids=[rng.randrange(vocab) for _ in range(n)],
                                 commit_start=0, root_token_id=rng.randrange(vocab), budget=4, reset=True)  # fmt: skip
        rows, cols, dtype = n, width, common_pb2.FLOAT32
        for _ in range(rng.randint(0, 3)):
            field = rng.choice(["shape", "dtype", "data", "tokens", "start", "root", "budget", "reset", "chain",
                                "table", "table_chain"])  # fmt: skip
            if field == "shape":
                rows, cols = rng.choice([(n + 1, width), (n, width + 1), (n, 0), (0, width), (n * width, 1)])
            elif field == "dtype":
                dtype = rng.choice([0, 2, 3, 4, 5, 99])
            elif field == "tokens":
                s.commit_token_ids.extend(rng.choice([-1, vocab, 2**31 - 1]) for _ in range(rng.randint(1, 3)))
            elif field == "start":
                s.commit_start = rng.choice([-1, 1, 2**31, 2**62, -(2**63)])
            elif field == "root":
                s.root_token_id = rng.choice([-1, vocab, 2**31 - 1])
            elif field == "budget":
                s.budget = rng.choice([*INT32, ctx["max_budget"], ctx["max_budget"] + 1])
            elif field == "reset":
                s.reset = False
            elif field == "chain":
                s.chain = True
            elif field == "table":  # a top-K table instead of a tree: 1..min(vocab, 256), else INVALID_ARGUMENT
                s.table_width = rng.choice([-(2**31), -1, 1, 2, 256, 257, vocab, vocab + 1, 2**31 - 1])
            elif field == "table_chain":  # both: refused as a whole
                s.table_width, s.chain = rng.choice([1, 2, 256]), True
            else:
                rows = -1  # data of the wrong length
        size = {0: 4, 1: 4, 2: 2, 3: 2, 4: 4, 5: 8}.get(dtype, 4)
        data = bytes(max(rows, 0) * cols * size) if rows >= 0 else bytes(rng.randrange(100))
        s.commit_features.CopyFrom(common_pb2.Tensor(data=data, shape=[max(rows, 0), cols], dtype=dtype))
        seqs.append(s)
        ctx["seq_ids"].add(seq_id)
    return drafter_pb2.DraftRequest(seqs=seqs)


def append(rng, ctx, big):
    """Append: a few CommitChunks (a stream), built like Draft's commits and mutated the same way; the
    pieces of one sequence are contiguous unless a mutation breaks them."""
    draft_msg = draft(rng, ctx, big)
    chunks, starts = [], {}
    for s in draft_msg.seqs:
        for _ in range(rng.choice([1, 1, 2, 3])):
            c = drafter_pb2.CommitChunk(seq_id=s.seq_id, commit_token_ids=s.commit_token_ids,
                                        commit_start=starts.get(s.seq_id, s.commit_start), reset=s.seq_id not in starts)  # fmt: skip
            c.commit_features.CopyFrom(s.commit_features)
            starts[s.seq_id] = c.commit_start + len(s.commit_token_ids)
            chunks.append(c)
    return chunks


def release(rng, ctx, big):
    n = rng.choice([0, 1, 10, 5000])
    ids = [rng.choice(["", "fuzz-fixed", "x" * 300, f"fuzz-{k}"]) for k in range(n)] + [text(rng, 30) for _ in range(3)]
    return drafter_pb2.ReleaseRequest(seq_ids=ids)


def empty(message):
    return lambda rng, ctx, big: message()


RPCS = {  # rpc -> (which process serves it, a mutated valid message)
    "ddtree.v1.Gateway/Chat": ("gateway", chat),
    "ddtree.v1.Gateway/Complete": ("gateway", complete),
    "ddtree.v1.Gateway/Tokenize": ("gateway", tokenize),
    "ddtree.v1.Gateway/GetInfo": ("gateway", empty(gateway_pb2.GatewayInfoRequest)),
    "ddtree.v1.Verifier/Generate": ("verifier", generate),
    "ddtree.v1.Verifier/Abort": ("verifier", abort),
    "ddtree.v1.Verifier/GetInfo": ("verifier", empty(verifier_pb2.VerifierInfoRequest)),
    "ddtree.v1.Drafter/Draft": ("drafter", draft),
    "ddtree.v1.Drafter/Append": ("drafter", append),  # client-streaming: a list of messages
    "ddtree.v1.Drafter/Release": ("drafter", release),
    "ddtree.v1.Drafter/GetInfo": ("drafter", empty(drafter_pb2.DrafterInfoRequest)),
}


def mutate_bytes(rng: random.Random, good: bytes) -> tuple[bytes, str]:
    kind = rng.randrange(9)
    if kind == 0:
        return bytes(rng.randrange(256) for _ in range(rng.randint(0, 300))), "random bytes"
    if kind == 1 and good:
        b = bytearray(good)
        for _ in range(rng.randint(1, 8)):
            b[rng.randrange(len(b))] = rng.randrange(256)
        return bytes(b), "flipped bytes"
    if kind == 2 and good:
        return good[: rng.randrange(len(good))], "truncated"
    if kind == 3:
        at = rng.randint(0, len(good))
        return good[:at] + bytes(rng.randrange(256) for _ in range(rng.randint(1, 20))) + good[at:], "inserted bytes"
    if kind == 4:
        return good + b"\xf8\x06\x01" + b"\x82\x07\x03abc", "unknown fields"  # fields 111 (varint), 112 (bytes)
    if kind == 5:
        return b"\x0a\xff\xff\xff\xff\x0f" + good[:20], "length prefix of 4 GB"
    if kind == 6:
        return rng.choice([b"\x0b" * 5000, b"\x08\x01", b"\x0d\x00\x00\x80\x7f", b"\x12\x01\xff"]), "wrong wire type"
    if kind == 7:
        return good * rng.randint(2, max(2, min(50, 200_000 // max(len(good), 1)))), "concatenated (merged) copies"
    return b"", "empty message"


def call(channel: grpc.Channel, rpc: str, payload: bytes, timeout: float) -> tuple[str, str]:
    """(code name, details) of one call; a stream is read for two messages, then cancelled (counted OK)."""
    try:
        if isinstance(payload, list):  # client-streaming
            channel.stream_unary(f"/{rpc}")(iter(payload), timeout=timeout)
        elif rpc in STREAMS:
            it = channel.unary_stream(f"/{rpc}")(payload, timeout=timeout)
            for n, _ in enumerate(it):
                if n == 1:
                    it.cancel()
                    break
        else:
            channel.unary_unary(f"/{rpc}")(payload, timeout=timeout)
        return "OK", ""
    except grpc.RpcError as e:
        return e.code().name, e.details() or ""


def run_grpc_fuzz(stack: FuzzStack, report: Report, rng: random.Random, n: int, workers: int, big: int) -> None:
    info = stack.drafter_info()
    ctx = {"width": len(info.target_layer_ids) * info.hidden_size, "vocab": stack.verifier_info().vocab_size,
           "max_budget": info.max_budget, "seq_ids": set()}  # fmt: skip
    addresses = {"gateway": stack.gateway, "verifier": stack.verifier, "drafter": stack.proc("drafter").address}
    channels = {name: grpc.insecure_channel(a, options=[("grpc.max_send_message_length", 64 << 20)])
                for name, a in addresses.items()}  # fmt: skip
    cases = []
    for rpc, (service, make) in RPCS.items():
        for _ in range(n):
            msg = make(rng, ctx, big)
            if isinstance(msg, list):  # a stream of messages: one of them mutated as bytes, sometimes
                payload, label = [m.SerializeToString() for m in msg], "typed mutation"
                if payload and rng.random() < 0.3:
                    k = rng.randrange(len(payload))
                    payload[k], label = mutate_bytes(rng, payload[k])
                    label = f"{label} (message {k} of the stream)"
                cases.append((rpc, service, payload, label, msg))
                continue
            payload, label = msg.SerializeToString(), "typed mutation"
            if rng.random() < 0.3 or isinstance(msg, (gateway_pb2.GatewayInfoRequest, verifier_pb2.VerifierInfoRequest,
                                                      drafter_pb2.DrafterInfoRequest)):  # fmt: skip
                payload, label = mutate_bytes(rng, payload)
            cases.append((rpc, service, payload, label, msg))
    rng.shuffle(cases)

    def one(case) -> None:
        rpc, service, payload, label, msg = case
        code, details = call(channels[service], rpc, payload, timeout=20.0)
        library = code == "INTERNAL" and details == GRPC_DESERIALIZE_ERROR
        report.status("grpc", rpc, "INTERNAL (grpcio: does not parse)" if library else code)
        if code in ("UNKNOWN", "INTERNAL") and not library:
            if isinstance(payload, list):
                shown = str(msg)[:1500] if label == "typed mutation" else [p[:200].hex() for p in payload[:4]]
            else:
                shown = str(msg)[:1500] if label == "typed mutation" else payload[:600].hex()
            report.fail("grpc fuzz", f"{rpc}: {code}: {details[:500]}", mutation=label, request=shown)

    try:
        with cf.ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, cases))
    finally:  # the fuzz cases' draft contexts: released, so the drafter's count is the verifier's again
        ids = [i for i in ctx["seq_ids"] if 0 < len(i) <= 256]
        for k in range(0, len(ids), 500):
            channels["drafter"].unary_unary("/ddtree.v1.Drafter/Release")(
                drafter_pb2.ReleaseRequest(seq_ids=ids[k : k + 500]).SerializeToString(), timeout=30
            )
        for ch in channels.values():
            ch.close()


def check_special_token_escaping(stack: FuzzStack, report: Report) -> dict:
    """Special-token text in a chat message (any role, content or reasoning) is encoded as plain text: the
    rendered prompt holds the same special tokens as with the text left out (Gateway.Tokenize)."""
    places = [("user", "content"), ("system", "content"), ("tool", "content"), ("assistant", "content"),
              ("assistant", "reasoning_content")]  # fmt: skip
    leaked = []
    with grpc.insecure_channel(stack.gateway) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)

        def specials(role: str, field: str, value: str) -> list[str]:
            m = gateway_pb2.ChatMessage
            msgs = {
                "user": [m(role="user", content=value)],
                "system": [m(role="system", **{field: value}), m(role="user", content="hi")],
                "assistant": [m(role="user", content="hi"), m(role="assistant", **{field: value}),
                              m(role="user", content="hi")],
                "tool": [m(role="user", content="hi"),
                         m(role="assistant", tool_calls=[gateway_pb2.ToolCall(id="call_0", name="f", arguments="{}")]),
                         m(role="tool", tool_call_id="call_0", content=value)],
            }[role]  # fmt: skip
            r = stub.Tokenize(gateway_pb2.TokenizeRequest(messages=msgs, add_generation_prompt=True), timeout=30)
            return sorted(t for t in r.tokens if t in SPECIAL_TOKENS)

        for role, field in places:
            plain = specials(role, field, "ab")
            for token in SPECIAL_TOKENS:
                if specials(role, field, f"a{token}b") != plain:
                    leaked.append(f"{role}.{field}: {token}")
    if leaked:
        report.fail("grpc fuzz", "special-token text in chat messages became special tokens", leaked=leaked[:20])
    return {"checked": len(places) * len(SPECIAL_TOKENS), "escaped": not leaked}
