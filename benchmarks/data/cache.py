"""Cached dataset: epoch time with and without the cache, and cache-hit throughput.

(a) A dataset whose ``__getitem__`` costs about 2 ms (a busy wait, like a decode + augment),
    read through a DataLoader: an epoch without the cache, the first epoch with it (computes
    and writes), the second (hits only). Target: second LMDB epoch >= 20x faster.
(b) Hit throughput in samples/s for ~3 KB NumPy samples (768 float32), ~600 KB tensors
    (3x224x224 float32) and (3 KB array, int label) tuples (a sample that goes through pickle),
    through ``CachedDataset`` (``ds[i]``, and ``ds.__getitems__`` of 64, which DataLoader calls
    per batch), against the raw store on the same payloads:
      raw LMDB: one read transaction + get + ``pickle.loads`` per sample (arrays pickled with
        protocol 5 in-band; tensors as their NumPy array, then ``torch.from_numpy``);
      raw Redis: one GET + ``pickle.loads`` per sample, and MGET of 64.
    Redis runs twice: RedisStore's local server (Unix socket) and a TCP redis-server on
    127.0.0.1, the raw client always on the same connection as the store.
    Targets: LMDB hits >= 80% of raw LMDB; Redis ``__getitems__`` >= 10x one GET per sample.
(c) Pickled samples ((3 KB array, label) tuples, a dict of tensors): the restricted unpickler
    (the default) against full unpickling (``trust_pickled_values=True``, what every value got
    before issue 24), in many short interleaved rounds, the best of each: LMDB hits through
    ``CachedDataset`` (``ds[i]`` and ``__getitems__``), and ``loads``/``dumps`` alone. Target:
    hits >= 0.95 of full unpickling.

Each figure is the best of ``--repeat`` runs (the machine may be shared). The last line printed
holds the key ratios. Usage::

    python -m benchmarks.data.cache            # full sizes
    python -m benchmarks.data.cache --quick    # smaller, for a smoke run
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import subprocess
import tempfile
import time
from typing import Callable

import lmdb
import numpy as np
import redis
import torch

from bagua.data import CachedDataset
from bagua.data.serialization import dumps, loads
from bagua.data.stores import stop_local_server
from benchmarks.jobs import free_port

BATCH = 64


class SlowDataset(torch.utils.data.Dataset):
    """3 KB arrays that cost ``cost_s`` each to "compute"."""

    def __init__(self, n: int, cost_s: float):
        self.n, self.cost_s = n, cost_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        end = time.perf_counter() + self.cost_s
        while time.perf_counter() < end:
            pass
        return np.full(768, i, dtype=np.float32)


class PayloadDataset(torch.utils.data.Dataset):
    def __init__(self, n: int, kind: str):
        self.n, self.kind = n, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        rng = np.random.default_rng(i)
        if self.kind == "dict of tensors":
            return {"img": torch.from_numpy(rng.standard_normal((3, 32, 32), dtype=np.float32)),
                    "label": torch.tensor(i % 10), "name": f"s{i}"}
        if self.kind == "3KB ndarray":
            return rng.standard_normal(768, dtype=np.float32)
        if self.kind == "tuple (3KB, label)":
            return rng.standard_normal(768, dtype=np.float32), i % 10
        return torch.from_numpy(rng.standard_normal((3, 224, 224), dtype=np.float32))


def best_rate(fn: Callable[[], int], repeat: int) -> float:
    """Samples/s of the fastest of ``repeat`` runs of ``fn`` (which returns samples done)."""
    best = 0.0
    for _ in range(repeat):
        t0 = time.perf_counter()
        n = fn()
        best = max(best, n / (time.perf_counter() - t0))
    return best


def epoch_time(ds, batch_size: int = 32) -> float:
    loader = torch.utils.data.DataLoader(ds, batch_size=batch_size, num_workers=0)
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t0


def start_tcp_redis(tmp: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen(
        [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1",
         "--save", "", "--appendonly", "no", "--dir", tmp, "--maxmemory", str(2 << 30),
         "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(500):
        try:
            client.ping()
            return proc, port
        except redis.exceptions.ConnectionError:
            time.sleep(0.02)
    raise SystemExit("redis-server did not start")


def raw_payload(value) -> bytes:
    return pickle.dumps(value.numpy() if isinstance(value, torch.Tensor) else value, protocol=5)


def raw_decode(data: bytes, tensor: bool):
    out = pickle.loads(data)
    return torch.from_numpy(out) if tensor else out


def restricted_vs_full(value, rounds: int, calls: int = 200) -> dict[str, tuple[float, float]]:
    """{"loads"/"dumps": (s per call restricted, with trust_pickled=True)}: the fastest of
    ``rounds`` interleaved rounds (the least disturbed by other jobs on a shared machine)."""
    data = dumps(value)
    fns = {"loads": lambda trust: loads(data, trust_pickled=trust),
           "dumps": lambda trust: dumps(value, trust_pickled=trust)}
    out = {}
    for name, fn in fns.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(rounds):
            for trust in (False, True):
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(trust)
                times[trust].append((time.perf_counter() - t0) / calls)
        out[name] = (min(times[False]), min(times[True]))
    return out


def batches(n: int) -> list[list[int]]:
    return [list(range(i, min(i + BATCH, n))) for i in range(0, n, BATCH)]


def main() -> None:
    ap = argparse.ArgumentParser(prog=f"python -m {__spec__.name}", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller sizes")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bagua-bench-cache-")
    os.environ["BAGUA_CACHE_DIR"] = tmp  # a private local Redis server and LMDB files
    rows: list[tuple[str, str, str, str]] = []
    key: dict[str, float] = {}
    tcp_proc = None
    try:
        # ---- (a) epoch time ---------------------------------------------------------------
        n_epoch = 300 if args.quick else 1000
        slow = SlowDataset(n_epoch, 0.002)
        t_plain = min(epoch_time(slow) for _ in range(2))
        rows.append(("(a) epoch, no cache", f"{n_epoch} x 2 ms samples", f"{t_plain:.3f} s", "1.0x"))
        for backend, kw in (("lmdb", {"path": os.path.join(tmp, "epoch-lmdb")}), ("redis", {})):
            ds = CachedDataset(slow, backend=backend, dataset_name="epoch", **kw)
            t1 = epoch_time(ds)
            ds.flush()
            t2 = min(epoch_time(ds) for _ in range(args.repeat))
            rows.append((f"(a) epoch 1, {backend} cache (fill)", "", f"{t1:.3f} s", f"{t_plain / t1:.2f}x"))
            rows.append((f"(a) epoch 2, {backend} cache (hits)", "", f"{t2:.4f} s", f"{t_plain / t2:.1f}x"))
            key[f"{backend}_epoch_speedup"] = t_plain / t2
            ds.close()

        # ---- (b) hit throughput -------------------------------------------------------------
        tcp_proc, tcp_port = start_tcp_redis(tmp)
        for kind, n in (("3KB ndarray", 2000 if args.quick else 6000), ("600KB tensor", 100 if args.quick else 300),
                        ("tuple (3KB, label)", 2000 if args.quick else 6000)):
            tensor = kind.endswith("tensor")
            src = PayloadDataset(n, kind)
            values = [raw_payload(src[i]) for i in range(n)]
            keys = [f"raw-{i}".encode() for i in range(n)]

            # LMDB: raw, then ours
            env = lmdb.open(os.path.join(tmp, f"raw-{kind[:3]}"), map_size=4 << 30)
            with env.begin(write=True) as txn:
                for k, v in zip(keys, values):
                    txn.put(k, v)

            def raw_lmdb() -> int:
                for k in keys:
                    with env.begin() as txn:
                        raw_decode(txn.get(k), tensor)
                return n

            def raw_lmdb_batch() -> int:  # what a batch costs: 64 per transaction, all kept
                for b in batches(n):
                    with env.begin() as txn:
                        kept = [raw_decode(txn.get(keys[i]), tensor) for i in b]
                    del kept
                return n

            ds = CachedDataset(src, path=os.path.join(tmp, f"lmdb-{kind[:3]}"), dataset_name=kind)
            ds.__getitems__(list(range(n)))
            ds.flush()

            def ours_item(ds=ds) -> int:
                for i in range(n):
                    ds[i]
                return n

            def ours_batch(ds=ds) -> int:
                for b in batches(n):
                    ds.__getitems__(b)
                return n

            rates = {}
            for _ in range(args.repeat):  # interleaved, best of each
                for name, fn in (("raw", raw_lmdb), ("rawb", raw_lmdb_batch), ("item", ours_item), ("batch", ours_batch)):
                    rates[name] = max(rates.get(name, 0.0), best_rate(fn, 1))
            rows.append(("(b) raw LMDB get+unpickle", kind, f"{rates['raw']:,.0f}/s", "1.00"))
            rows.append((f"(b) raw LMDB, {BATCH} per txn, batch kept", kind, f"{rates['rawb']:,.0f}/s", f"{rates['rawb'] / rates['raw']:.2f}"))
            rows.append(("(b) CachedDataset lmdb ds[i]", kind, f"{rates['item']:,.0f}/s", f"{rates['item'] / rates['raw']:.2f}"))
            rows.append((f"(b) CachedDataset lmdb __getitems__({BATCH})", kind, f"{rates['batch']:,.0f}/s",
                         f"{rates['batch'] / rates['raw']:.2f} ({rates['batch'] / rates['rawb']:.2f} of batched raw)"))
            key[f"lmdb_item_{kind[:3]}"] = rates["item"] / rates["raw"]
            key[f"lmdb_batch_{kind[:3]}"] = rates["batch"] / rates["rawb"]
            ds.close()
            env.close()

            # Redis: the local server (Unix socket) and a TCP server
            for transport in ("unix", "tcp"):
                kw = {} if transport == "unix" else {"hosts": [{"host": "127.0.0.1", "port": tcp_port}]}
                ds = CachedDataset(src, backend="redis", dataset_name=kind, **kw)
                store = ds.cache_loader.store
                raw = (redis.Redis(unix_socket_path=store.hosts[0][len("unix:"):]) if transport == "unix"
                       else redis.Redis(port=tcp_port))
                raw.mset(dict(zip(keys, values)))
                ds.__getitems__(list(range(n)))
                ds.flush()

                def raw_get(raw=raw) -> int:
                    for k in keys:
                        raw_decode(raw.get(k), tensor)
                    return n

                def raw_mget(raw=raw) -> int:
                    for b in batches(n):
                        for v in raw.mget([keys[i] for i in b]):
                            raw_decode(v, tensor)
                    return n

                def raw_mget_kept(raw=raw) -> int:  # what a batch costs: all 64 decoded samples kept
                    for b in batches(n):
                        kept = [raw_decode(v, tensor) for v in raw.mget([keys[i] for i in b])]
                        del kept
                    return n

                def ours_batch(ds=ds) -> int:
                    for b in batches(n):
                        ds.__getitems__(b)
                    return n

                def ours_item(ds=ds) -> int:
                    for i in range(n):
                        ds[i]
                    return n

                rates = {}
                for _ in range(args.repeat):
                    for name, fn in (("get", raw_get), ("mget", raw_mget), ("mgetk", raw_mget_kept),
                                     ("batch", ours_batch), ("item", ours_item)):
                        rates[name] = max(rates.get(name, 0.0), best_rate(fn, 1))
                label = f"redis/{transport}"
                rows.append((f"(b) raw {label} GET per sample", kind, f"{rates['get']:,.0f}/s", "1.00"))
                rows.append((f"(b) raw {label} MGET of {BATCH}", kind, f"{rates['mget']:,.0f}/s", f"{rates['mget'] / rates['get']:.1f}"))
                rows.append((f"(b) raw {label} MGET of {BATCH}, batch kept", kind, f"{rates['mgetk']:,.0f}/s", f"{rates['mgetk'] / rates['get']:.1f}"))
                rows.append((f"(b) CachedDataset {label} ds[i]", kind, f"{rates['item']:,.0f}/s", f"{rates['item'] / rates['get']:.1f}"))
                rows.append((f"(b) CachedDataset {label} __getitems__({BATCH})", kind, f"{rates['batch']:,.0f}/s",
                             f"{rates['batch'] / rates['get']:.1f} ({rates['batch'] / rates['mgetk']:.2f} of MGET kept)"))
                key[f"{transport}_batch_{kind[:3]}"] = rates["batch"] / rates["get"]
                key[f"{transport}_vs_mget_{kind[:3]}"] = rates["batch"] / rates["mget"]
                raw.flushdb() if transport == "tcp" else raw.delete(*keys)
                raw.close()
                ds.close()

        # ---- (c) pickled samples: restricted vs full unpickling --------------------------------
        n = 500 if args.quick else 2000  # short rounds, many of them
        for kind in ("tuple (3KB, label)", "dict of tensors"):
            src = PayloadDataset(n, kind)
            path = os.path.join(tmp, f"trust-{kind[:3]}")
            restricted = CachedDataset(src, path=path, dataset_name=kind)
            restricted.__getitems__(list(range(n)))
            restricted.flush()
            trusting = CachedDataset(src, path=path, dataset_name=kind, trust_pickled_values=True)

            def item_pass(ds) -> int:
                for i in range(n):
                    ds[i]
                return n

            def batch_pass(ds) -> int:
                for b in batches(n):
                    ds.__getitems__(b)
                return n

            rates = {}
            for _ in range(20 * args.repeat):  # many short rounds, interleaved, best of each
                for name, fn, ds in (("item", item_pass, restricted), ("item_t", item_pass, trusting),
                                     ("batch", batch_pass, restricted), ("batch_t", batch_pass, trusting)):
                    rates[name] = max(rates.get(name, 0.0), best_rate(lambda: fn(ds), 1))
            for what, r, t in (("ds[i]", "item", "item_t"), (f"__getitems__({BATCH})", "batch", "batch_t")):
                rows.append((f"(c) lmdb {what}, restricted / full unpickling", kind,
                             f"{rates[r]:,.0f} / {rates[t]:,.0f}/s", f"{rates[r] / rates[t]:.3f}"))
                key[f"hits_{r}_{kind[:3]}"] = rates[r] / rates[t]
            for name, (r, t) in restricted_vs_full(src[0], 50 if args.quick else 150).items():
                rows.append((f"(c) {name} alone, restricted / full", kind, f"{r * 1e6:.2f} / {t * 1e6:.2f} us",
                             f"{r / t:.3f}"))
            restricted.close()
            trusting.close()
    finally:
        if tcp_proc is not None:
            tcp_proc.kill()
        stop_local_server(tmp)
        shutil.rmtree(tmp, ignore_errors=True)

    w = [max(len(r[i]) for r in rows + [("case", "payload", "result", "ratio")]) for i in range(4)]
    print(f"{'case':<{w[0]}}  {'payload':<{w[1]}}  {'result':>{w[2]}}  {'ratio':>{w[3]}}")
    for r in rows:
        print(f"{r[0]:<{w[0]}}  {r[1]:<{w[1]}}  {r[2]:>{w[2]}}  {r[3]:>{w[3]}}")
    print("(a) ratio: epoch time without cache / with; (b) lmdb ratio: / raw LMDB per sample (and / raw LMDB "
          f"batched, {BATCH} per transaction); redis ratio: / one GET per sample; (c) ratio: restricted / full "
          "unpickling")
    print(
        f"key ratios: lmdb epoch-2 speedup {key['lmdb_epoch_speedup']:.1f}x (target >= 20x) | "
        f"lmdb hits / raw, ds[i]: 3KB {key['lmdb_item_3KB']:.2f}, 600KB {key['lmdb_item_600']:.2f}; "
        f"tuple {key['lmdb_item_tup']:.2f}; "
        f"__getitems__ / batched raw: 3KB {key['lmdb_batch_3KB']:.2f}, 600KB {key['lmdb_batch_600']:.2f}, "
        f"tuple {key['lmdb_batch_tup']:.2f} (target >= 0.80) | "
        f"redis __getitems__ / GET: unix 3KB {key['unix_batch_3KB']:.1f}x, 600KB {key['unix_batch_600']:.1f}x; "
        f"tcp 3KB {key['tcp_batch_3KB']:.1f}x, 600KB {key['tcp_batch_600']:.1f}x, tuple {key['tcp_batch_tup']:.1f}x "
        f"(target >= 10x) | lmdb hits restricted / full unpickling, ds[i]: tuple {key['hits_item_tup']:.3f}, "
        f"dict {key['hits_item_dic']:.3f}; __getitems__: tuple {key['hits_batch_tup']:.3f}, "
        f"dict {key['hits_batch_dic']:.3f} (target >= 0.95)"
    )


if __name__ == "__main__":
    main()
