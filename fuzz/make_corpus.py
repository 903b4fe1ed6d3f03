#!/usr/bin/env python3
"""Writes the seed corpora under fuzz/corpus/ (standard library only).

Seeds are small on purpose: libFuzzer mutates from them, and the corpus
replay test (tests/reliability/fuzz_corpus_test.cc) runs all of them on every
CI build. Re-running this script rewrites the same files.

  npy/         valid files of every supported type and version, plus files
               the reader must refuse (Fortran order, big-endian, truncated,
               trailing bytes, bad dict)
  mask_parse/  mask texts: every term, offsets at the int64 limits, nesting
  attention/   byte strings decoded by fuzz/attention_problem.cc (the bytes
               choose shapes, dtypes, strides and options; fixed PRNG seeds)

The files named by a 40-digit hash next to them are not written here: they
are the inputs of earlier fuzzing campaigns, minimised with
`<target>_fuzzer -merge=1 NEW_DIR OLD_DIRS...` (every one adds coverage). Add
new ones the same way; see docs/RELIABILITY.md.
"""
import os
import random
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def write(target, name, data):
    d = os.path.join(HERE, "corpus", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def npy(descr, shape, payload, version=(1, 0), fortran=False, dict_text=None):
    if dict_text is None:
        shp = "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"
        dict_text = "{'descr': '%s', 'fortran_order': %s, 'shape': %s, }" % (
            descr, "True" if fortran else "False", shp)
    len_bytes = 2 if version[0] == 1 else 4
    unpadded = 6 + 2 + len_bytes + len(dict_text) + 1
    body = dict_text + " " * ((64 - unpadded % 64) % 64) + "\n"
    length = struct.pack("<H" if len_bytes == 2 else "<I", len(body))
    return b"\x93NUMPY" + bytes(version) + length + body.encode("latin-1") + payload


def npy_seeds():
    f32 = lambda n: struct.pack("<%df" % n, *[0.5 * i - 1 for i in range(n)])
    write("npy", "f32_2x3.npy", npy("<f4", (2, 3), f32(6)))
    write("npy", "f32_q_1x4x2x2.npy", npy("<f4", (1, 4, 2, 2), f32(16)))
    write("npy", "f16_4.npy", npy("<f2", (4,), struct.pack("<4e", 1.0, -2.0, 65504.0, 6e-5)))
    write("npy", "i32_2x2_v2.npy", npy("<i4", (2, 2), struct.pack("<4i", 0, 1, -1, 7), (2, 0)))
    write("npy", "i64_3_v3.npy", npy("<i8", (3,), struct.pack("<3q", 1, 2**40, -3), (3, 0)))
    write("npy", "bool_2x2.npy", npy("|b1", (2, 2), bytes([1, 0, 0, 1])))
    write("npy", "u8_1.npy", npy("|u1", (1,), bytes([200])))
    write("npy", "i8_2.npy", npy("|i1", (2,), bytes([0x80, 0x7f])))
    write("npy", "scalar_f32.npy", npy("<f4", (), f32(1)))
    write("npy", "empty_0x3.npy", npy("<f4", (0, 3), b""))
    write("npy", "reordered_keys.npy",
          npy("<f4", None, f32(2), dict_text="{'shape': (2,), 'fortran_order': False, "
              "'descr': '<f4'}"))
    write("npy", "reject_fortran.npy", npy("<f4", (2, 2), f32(4), fortran=True))
    write("npy", "reject_big_endian.npy", npy(">f4", (2,), f32(2)))
    write("npy", "reject_truncated.npy", npy("<f4", (4, 4), f32(3)))
    write("npy", "reject_trailing.npy", npy("<i4", (1,), b"\0" * 8))
    write("npy", "reject_f64.npy", npy("<f8", (1,), b"\0" * 8))
    write("npy", "reject_bad_dict.npy",
          npy("<f4", None, b"", dict_text="{'descr': '<f4', 'shape': (-1,), }"))
    write("npy", "reject_huge_shape.npy",
          npy("<f4", None, b"", dict_text="{'descr': '<f4', 'fortran_order': False, "
              "'shape': (4294967296, 4294967296), }"))
    write("npy", "reject_version.npy", npy("<f4", (1,), f32(1), (4, 0)))
    write("npy", "reject_magic.npy", b"\x93NUMPz\x01\x00")


def mask_seeds():
    texts = [
        "full", "causal", "causal:-3", "causal:12", "local:4,0", "local:,8,2", "local:3,",
        "chunked:16", "causal & local:8,", "(causal | local:2,2) & chunked:8",
        "local:3,3,-5 | full", " causal:5 & ( chunked:7 | local:,0 ) ",
        "causal:9223372036854775807", "local:0,0,-9223372036854775808",
        "chunked:9223372036854775807 | causal:-9223372036854775808",
        "local:9223372036854775807,9223372036854775807,-9223372036854775807",
        "((causal))", "causal &", "local:1", "chunked:0", "causal:1.5",
    ]
    for i, t in enumerate(texts):
        write("mask_parse", "seed_%02d.txt" % i, t)


def attention_seeds():
    rng = random.Random(20240601)
    for i in range(24):
        n = rng.randrange(48, 160)
        data = bytearray(rng.randrange(256) for _ in range(n))
        # Byte 4 picks how many arguments are broken (< 150: none): half the
        # seeds are valid calls, the other half break one or two arguments.
        data[4] = rng.randrange(0, 150) if i % 2 == 0 else rng.randrange(150, 256)
        write("attention", "seed_%02d.bin" % i, bytes(data))


if __name__ == "__main__":
    npy_seeds()
    mask_seeds()
    attention_seeds()
