#!/usr/bin/env python3
"""Writes the seed corpora in fuzz/corpus/ from the repository's own test data: request bodies and
raw HTTP from the server tests, chat cases from tests/data/chat, tokenizer texts from
tests/data/tokenizer, parser outputs from the stream-parser tests, and small checkpoints/configs.
Each seed starts with the harness's control bytes (see the harness). Rerun after changing a
harness's input layout; regression inputs found by fuzzing live next to the seeds (crash-*)."""
import hashlib, json, os, re, struct, sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "fuzz", "corpus")


def write(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def cpp_raw_strings(src):
    return re.findall(r'R"\((.*?)\)"', src, re.S)


def spread(items, n):
    """At most n items, evenly spaced (keeps the variety of a long list)."""
    if len(items) <= n:
        return items
    return [items[k * len(items) // n] for k in range(n)]


def slug(i, s):
    return "%02d-%s" % (i, hashlib.sha1(s.encode() if isinstance(s, str) else s).hexdigest()[:8])


# ---- chat / completions request bodies ------------------------------------------------------------
def chat_seeds():
    bodies = []
    for rel in ["tests/test_server_api.cpp", "tests/test_openai_protocol.cpp", "tests/test_server_e2e.cpp",
                "tests/test_server_http.cpp"]:
        for s in cpp_raw_strings(read(rel)):
            try:
                j = json.loads(s)
            except ValueError:
                continue
            if isinstance(j, dict) and ("messages" in j or "prompt" in j):
                bodies.append(j)
    for case in json.loads(read("tests/data/chat/v3_family_cases.json")):
        body = {"messages": case["messages"]}
        for k in ("tools", "tool_choice", "response_format"):
            if k in case:
                body[k] = case[k]
        if case.get("thinking"):
            body["thinking"] = {"type": "enabled"}
        bodies.append(body)
    bodies += [
        {"model": "deepinfer-tiny", "messages": [{"role": "user", "content": "Hello"}], "stream": True,
         "stream_options": {"include_usage": True}, "max_tokens": 8, "temperature": 0.7, "seed": 1},
        {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 10}, "stop": ["\n", "END"],
         "logprobs": True, "top_logprobs": 2, "n": 2},
        {"messages": [{"role": "user", "content": "weather?"}], "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": "Weather", "parameters": {"type": "object", "properties": {
                "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}}, "required": ["city"]}}}],
         "tool_choice": "required", "parallel_tool_calls": False},
        {"messages": [{"role": "user", "content": "json"}], "response_format": {"type": "json_schema", "json_schema": {
            "name": "r", "schema": {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "number"}}}}}}},
        {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": [{"type": "text", "text": "parts"}]},
                      {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                       "function": {"name": "f", "arguments": "{\"a\": {\"b\": [1, {\"c\": null}]}}"}}]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "42"}], "reasoning_effort": "high"},
        {"prompt": "Once upon a time", "max_tokens": 4, "echo": True},
        {"prompt": [0, 1234, 5678], "stop": "\n\n", "logprobs": 3},
        {"prompt": ["a", [5, 6], "c"], "n": 2, "best_of": 2},
        {"messages": [{"role": "user", "content": "hi"}], "test_forced_output": "Hello<｜end▁of▁sentence｜>"},
    ]
    i = 0
    for b in spread(bodies[:-9], 31) + bodies[-9:]:
        text = json.dumps(b, ensure_ascii=False)
        chat = "messages" in b
        # mode byte: bit0 completions, bits1-2 context, bits3-5 chat format, bit6 thinking, bit7 hooks
        fmt = i % 5
        mode = (0 if chat else 1) | ((i % 4) << 1) | (fmt << 3) | (0x40 if i % 3 == 0 else 0) | (0x80 if "test_forced_output" in b else 0)
        if (i % 4) == 1:  # keep most seeds on the roomy contexts
            mode = (mode & ~6) | (2 << 1)
        write("fuzz_chat_request", slug(i, text), bytes([mode]) + text.encode())
        i += 1
    for bad in ['{"messages": [', '[]', '{"messages": "x"}', '{"messages": [{"role": "wizard", "content": "x"}]}',
                '{"prompt": "\\ud800"}', '{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1e400}']:
        write("fuzz_chat_request", slug(i, bad), bytes([i & 1]) + bad.encode())
        i += 1


# ---- raw HTTP ---------------------------------------------------------------------------------------
def http_seeds():
    body = '{"messages":[{"role":"user","content":"hi"}],"max_tokens":4}'
    cl = "Content-Length: %d\r\n" % len(body)
    reqs = [
        "GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "GET /v1/models?x=1 HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k\r\n\r\n",
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + cl + "\r\n" + body,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body),
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5;ext=1\r\n{\"a\":\r\n3\r\n 1}\r\n0\r\nTrailer: t\r\n\r\n",
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n" + cl + "\r\n" + body,
        "POST /v1/chat/completions HTTP/1.0\r\n" + cl + "\r\n" + body,
        "GET /health HTTP/1.0\r\nConnection: keep-alive\r\n\r\n",
        "GET /health HTTP/1.1\r\nConnection: close\r\n\r\n",
        "GET /health HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\n\r\nPOST /v1/chat/completions HTTP/1.1\r\n" + cl + "\r\n" + body,
        "POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        "POST / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: identity\r\n\r\n0\r\n\r\n",
        "GET http://127.0.0.1:8000/v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        "HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n",
        "OPTIONS * HTTP/1.1\r\nOrigin: http://a\r\nAccess-Control-Request-Method: POST\r\n\r\n",
        "GET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n",
        "GET / HTTP/1.1\r\nBad Header: x\r\n\r\n",
        "GET / HTTP/1.1\nHost: x\n\n",
        "THIS IS NOT HTTP\r\n\r\n",
        "POST / HTTP/1.1\r\nContent-Length: 99999999999999999999\r\n\r\n",
        "POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        "POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffffff\r\n",
        "GET / HTTP/2.0\r\n\r\n",
        "GET /\x00 HTTP/1.1\r\n\r\n",
        "POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 5000\r\n\r\n{\"partial",
        "GET /health HTTP/1.1\r\n" + "X-Long: " + "a" * 1500 + "\r\n\r\n",
    ]
    for i, r in enumerate(reqs):
        # control bytes: limits (bits 0-3; 0 = the server's defaults), cut seed; bit7 = tiny reads
        mode = [0, 0, 0x80, 1, 2, 3, 4, 8, 12, 0x83][i % 10]
        write("fuzz_http_request", slug(i, r), bytes([mode, i * 17 & 0xff]) + r.encode("latin-1"))


# ---- tokenizer ----------------------------------------------------------------------------------------
def tokenizer_seeds():
    lines = [json.loads(l) for l in read("tests/data/tokenizer/corpus.jsonl").split("\n") if l.strip()]
    picked, seen = [], set()
    step = max(1, len(lines) // 24)
    for l in lines[::step]:
        t = l["text"]
        if t not in seen and len(t.encode()) < 3000:
            seen.add(t)
            picked.append(l)
    i = 0
    for l in picked:
        write("fuzz_tokenizer", slug(i, l["text"]), b"\x00" + l["text"].encode())
        i += 1
    for t in ["<｜User｜>hi<｜Assistant｜></think>", "<｜DSML｜ calls>\n", "   \t\n\r\n  x", "🙂👍🏽 日本語 ﷽", "a\u0301\u200d"]:
        write("fuzz_tokenizer", slug(i, t), b"\x00" + t.encode())
        i += 1
    write("fuzz_tokenizer", slug(i, "invalid"), b"\x00a\xff\xfeb\xe3\x81")
    i += 1
    for l in picked[:8]:
        ids = l["ids"][:64]
        data = b"".join(struct.pack("<I", x)[:3] for x in ids)
        write("fuzz_tokenizer", slug(i, data), b"\x01" + data)
        i += 1
    write("fuzz_tokenizer", slug(i, "special-ids"), b"\x01" + b"".join(struct.pack("<I", x)[:3] for x in [0, 1, 128798, 128799, 129279, 300, 104]))


# ---- stream parser -----------------------------------------------------------------------------------
def stream_seeds():
    src = read("tests/test_stream_parser.cpp")
    texts = [bytes(s, "utf-8").decode("unicode_escape").encode("latin-1").decode("utf-8", "replace")
             for s in re.findall(r'"((?:[^"\\\n]|\\.)*)"', src) if len(s) > 6]
    texts += [
        "I'll check.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name=\"submit\">\n<｜DSML｜ parameter name=\"a\" string=\"true\">Paris\n日本</｜DSML｜ parameter>\n"
        "<｜DSML｜ parameter name=\"n\" string=\"false\">2</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n</｜DSML｜ calls>",
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"q\": \"x\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "\nthinking 日本語 🙂\n</think>\n\nThe answer.",
        "```json\n{\"a\": [1, 2]}\n```\nThanks",
        "Hello STOP world",
    ]
    seen, i = set(), 0
    texts = [t for t in texts if any(k in t for k in ("｜", "think", "```", "STOP", "\\n"))]
    for t in spread(texts[:-6], 30) + texts[-6:]:
        if t in seen:
            continue
        seen.add(t)
        syntax = 1 if "tool▁call▁begin｜>function" in t else 2 if "tool▁sep｜>{" in t else 0
        a = syntax | (16 if "</think>" in t else 0) | (32 if "```json" in t else 0) | (128 if i % 5 == 4 else 0)
        if "STOP" in t:
            write("fuzz_stream_parser", slug(i, t), bytes([a, 1, i & 0xff, 4]) + b"STOP" + t.encode())
        else:
            write("fuzz_stream_parser", slug(i, t), bytes([a, 4 if i % 3 == 0 else 0, i & 0xff]) + t.encode())
        i += 1


# ---- safetensors and config ---------------------------------------------------------------------------
def safetensors_file(tensors, metadata=None):
    header, data = {}, b""
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    if metadata:
        header["__metadata__"] = metadata
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data, h, len(data)


def safetensors_seeds():
    files = [
        [("w", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4))],
        [("a.weight", "BF16", [3], b"\x80\x3f" * 3), ("b.scale", "F8_E8M0", [2], b"\x7f\x80"),
         ("c", "F8_E4M3", [2, 2], b"\x38\x40\x48\xb8")],
        [("empty", "F32", [0, 4], b""), ("scalar", "I64", [], struct.pack("<q", -5))],
        [("i8", "I8", [4], b"\x01\xff\x02\xfe"), ("u8", "U8", [1, 1, 2], b"\x00\xff"), ("b", "BOOL", [2], b"\x00\x01"),
         ("i16", "I16", [1], b"\x01\x00"), ("i32", "I32", [1], b"\x01\x00\x00\x00"), ("f16", "F16", [1], b"\x00\x3c"),
         ("f64", "F64", [1], struct.pack("<d", 1.5))],
    ]
    i = 0
    for n, t in enumerate(files):
        whole, header, ndata = safetensors_file(t, {"format": "pt", "n": str(n)} if n % 2 else None)
        write("fuzz_safetensors", slug(i, whole), b"\x00\x00" + whole)
        i += 1
        write("fuzz_safetensors", slug(i, header), bytes([1, (ndata + 3) // 4]) + header)
        i += 1
    for bad in [b"", b"\x05\x00\x00\x00\x00\x00\x00\x00{}   ", b"\xff" * 8 + b"{}",
                b'\x10\x00\x00\x00\x00\x00\x00\x00{"a":{"dtype":1}}']:
        write("fuzz_safetensors", slug(i, bad), b"\x00\x00" + bad)
        i += 1
    for idx in [
        {"metadata": {"total_size": 32}, "weight_map": {"x.weight": "a.safetensors", "y.weight": "b.safetensors", "z.bias": "b.safetensors"}},
        {"weight_map": {"x.weight": "a.safetensors"}},
        {"weight_map": {"x.weight": "../a.safetensors", "y.weight": "b.safetensors", "z.bias": "b.safetensors"}},
        {"weight_map": {"x.weight": "b.safetensors", "y.weight": "b.safetensors", "z.bias": "b.safetensors"}},
        {"weight_map": []},
    ]:
        t = json.dumps(idx)
        write("fuzz_safetensors", slug(i, t), b"\x02\x00" + t.encode())
        i += 1
    # The real tiny model's header (its data section is missing here: must be rejected cleanly).
    with open(os.path.join(ROOT, "tests/data/golden/v41-tiny/model/model.safetensors"), "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        if n < 60000:
            write("fuzz_safetensors", slug(i, "golden-header"), b"\x01\xff" + f.read(n))


def config_seeds():
    base = json.loads(read("tests/data/golden/v41-tiny/model/config.json"))
    write("fuzz_config", "00-golden", json.dumps(base, indent=2))
    variants = []
    import copy
    c = copy.deepcopy(base); c["text_config"].pop("compress_ratios", None); variants.append(c)
    c = copy.deepcopy(base); c["text_config"]["num_hidden_layers"] = 2; variants.append(c)
    c = copy.deepcopy(base); c["text_config"]["hidden_size"] = "64"; variants.append(c)
    c = copy.deepcopy(base); c["quantization_config"] = None; variants.append(c)
    c = copy.deepcopy(base); c["text_config"]["vocab_size"] = -1; variants.append(c)
    c = copy.deepcopy(base); c["text_config"]["rope_scaling"]["factor"] = 1e309 if False else 1e300; variants.append(c)
    c = copy.deepcopy(base); c.pop("text_config"); variants.append(c)
    c = copy.deepcopy(base); c["text_config"]["num_attention_heads"] = 0; variants.append(c)
    for i, v in enumerate(variants, 1):
        write("fuzz_config", "%02d-variant" % i, json.dumps(v))
    write("fuzz_config", "20-not-object", "[1, 2]")
    write("fuzz_config", "21-truncated", json.dumps(base)[:200])


if __name__ == "__main__":
    chat_seeds(); http_seeds(); tokenizer_seeds(); stream_seeds(); safetensors_seeds(); config_seeds()
    for t in sorted(os.listdir(OUT)):
        print(t, len(os.listdir(os.path.join(OUT, t))))
