"""A Google Cloud Storage bucket on localhost for the tests: one object store, two ways in.

- **HTTP** (:class:`Server`): the part of the GCS JSON API that tensorstore (Orbax's array writer) speaks:
  media downloads (ranges, ``ifGenerationMatch`` / ``ifGenerationNotMatch``), media uploads with their
  preconditions, object metadata, listing by prefix / offsets, deletes. ``TENSORSTORE_GCS_HTTP_URL`` points
  tensorstore at it.
- **Python** (:class:`Backend`): an ``etils.epath`` backend over the same objects, for what goes through
  ``epath`` (``fileio``'s URL calls, Orbax's folder bookkeeping). On a real bucket that backend is
  ``tf.io.gfile``; the semantics copied here are its GCS ones: folders are name prefixes (``mkdir`` writes the
  ``name/`` marker object), a folder rename moves every object under it.

:func:`bucket` (a context manager) starts both, routes every ``gs://`` path of this process to them and yields
the store, so a test can assert what a job wrote and that nothing went elsewhere. Not covered: TensorBoard's
events file (TensorFlow's C++ GCS client has a fixed endpoint; under the fake bucket the scalars are logged).
"""
from __future__ import annotations

import contextlib
import fnmatch
import http.server
import io
import json
import os
import threading
import urllib.parse

from etils.epath import backend as epath_backend
from etils.epath import stat_utils


class Store:
  """Objects ``"bucket/name" -> (bytes, generation)`` under one lock."""

  def __init__(self):
    self.lock, self.objects, self._gen = threading.Lock(), {}, 0

  def put(self, key: str, data: bytes, if_match: int | None = None) -> int | None:
    """Write ``key``; ``None`` when the precondition (``if_match``: its generation, 0 = absent) fails."""
    with self.lock:
      if if_match is not None and self.objects.get(key, (b"", 0))[1] != if_match:
        return None
      self._gen += 1
      self.objects[key] = (bytes(data), self._gen)
      return self._gen

  def get(self, key: str):
    with self.lock:
      return self.objects.get(key)

  def delete(self, key: str) -> bool:
    with self.lock:
      return self.objects.pop(key, None) is not None

  def names(self, prefix: str = "") -> list[str]:
    with self.lock:
      return sorted(k for k in self.objects if k.startswith(prefix))

  def files(self) -> dict[str, bytes]:
    """``{"bucket/name": bytes}`` of the objects that are not folder markers."""
    with self.lock:
      return {k: v[0] for k, v in sorted(self.objects.items()) if not k.endswith("/")}


def _resource(bucket: str, name: str, data: bytes, gen: int) -> dict:
  return {"kind": "storage#object", "bucket": bucket, "name": name, "size": str(len(data)),
          "generation": str(gen), "metageneration": "1", "updated": "2026-01-01T00:00:00.000Z"}


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  store: Store

  def log_message(self, *args):  # quiet
    pass

  def _reply(self, code: int, body: bytes = b"", headers: dict | None = None, ctype="application/json"):
    self.send_response(code)
    for k, v in (headers or {}).items():
      self.send_header(k, v)
    self.send_header("Content-Type", ctype)
    self.send_header("Content-Length", str(len(body)))
    self.end_headers()
    if self.command != "HEAD":
      self.wfile.write(body)

  def _json(self, code: int, obj):
    self._reply(code, json.dumps(obj).encode())

  def _parse(self):
    url = urllib.parse.urlsplit(self.path)
    q = {k: v[-1] for k, v in urllib.parse.parse_qs(url.query, keep_blank_values=True).items()}
    parts = url.path.split("/")
    return parts, q

  def _object(self, parts):
    """``(bucket, name)`` of ``/storage/v1/b/B/o/NAME`` (NAME percent-encoded), else ``(bucket, None)``."""
    i = parts.index("b")
    bucket = parts[i + 1]
    name = urllib.parse.unquote("/".join(parts[i + 3:])) if len(parts) > i + 3 else None
    return bucket, name

  def _body(self) -> bytes:
    n = int(self.headers.get("Content-Length") or 0)
    return self.rfile.read(n) if n else b""

  def do_GET(self):
    parts, q = self._parse()
    bucket, name = self._object(parts)
    if name is None:  # list
      return self._list(bucket, q) if "o" in parts else self._json(200, {"kind": "storage#bucket", "name": bucket})
    hit = self.store.get(f"{bucket}/{name}")
    if hit is None:
      return self._json(404, {"error": {"code": 404, "message": "No such object"}})
    data, gen = hit
    if "ifGenerationMatch" in q and int(q["ifGenerationMatch"]) != gen:
      return self._json(412, {"error": {"code": 412, "message": "Precondition Failed"}})
    if "ifGenerationNotMatch" in q and int(q["ifGenerationNotMatch"]) == gen:
      return self._reply(304, headers={"x-goog-generation": str(gen)})
    if q.get("alt") != "media":
      return self._json(200, _resource(bucket, name, data, gen))
    headers, code = {"x-goog-generation": str(gen), "x-goog-metageneration": "1"}, 200
    rng = self.headers.get("Range")
    if rng and rng.startswith("bytes="):
      a, _, b = rng[6:].partition("-")
      if a == "":  # suffix
        start, end = max(0, len(data) - int(b)), len(data) - 1
      else:
        start, end = int(a), (int(b) if b else len(data) - 1)
      if start >= len(data) and len(data):
        return self._reply(416, headers=headers)
      headers["Content-Range"] = f"bytes {start}-{min(end, len(data) - 1)}/{len(data)}"
      data, code = data[start:end + 1], 206
    self._reply(code, data, headers, ctype="application/octet-stream")

  def _list(self, bucket, q):
    prefix, start, end = q.get("prefix", ""), q.get("startOffset", ""), q.get("endOffset")
    items = []
    for key in self.store.names(f"{bucket}/{prefix}"):
      name = key[len(bucket) + 1:]
      if name < start or (end and name >= end):
        continue
      data, gen = self.store.get(key) or (b"", 0)
      items.append(_resource(bucket, name, data, gen))
    self._json(200, {"kind": "storage#objects", "items": items})

  def do_POST(self):
    parts, q = self._parse()
    body = self._body()
    if "upload" not in parts or q.get("uploadType") != "media":
      return self._json(400, {"error": {"code": 400, "message": f"unsupported request {self.path}"}})
    bucket = parts[parts.index("b") + 1]
    name = q["name"]
    gen = self.store.put(f"{bucket}/{name}", body,
                         int(q["ifGenerationMatch"]) if "ifGenerationMatch" in q else None)
    if gen is None:
      return self._json(412, {"error": {"code": 412, "message": "Precondition Failed"}})
    self._json(200, _resource(bucket, name, body, gen))

  def do_DELETE(self):
    parts, q = self._parse()
    bucket, name = self._object(parts)
    key = f"{bucket}/{name}"
    hit = self.store.get(key)
    if hit is None:
      return self._json(404, {"error": {"code": 404, "message": "No such object"}})
    if "ifGenerationMatch" in q and int(q["ifGenerationMatch"]) != hit[1]:
      return self._json(412, {"error": {"code": 412, "message": "Precondition Failed"}})
    self.store.delete(key)
    self._reply(204)


class Server:
  """The HTTP side on ``127.0.0.1:<free port>`` (a daemon thread); ``url`` is its base URL."""

  def __init__(self, store: Store):
    handler = type("Handler", (_Handler,), {"store": store})
    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    self.httpd.daemon_threads = True
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
    threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

  def close(self):
    self.httpd.shutdown()
    self.httpd.server_close()


def _key(path) -> str:
  path = os.fspath(path)
  assert path.startswith("gs://"), path
  return path[len("gs://"):].rstrip("/")


class _Writer(io.BytesIO):
  def __init__(self, store, key, initial=b""):
    super().__init__(initial)
    self.seek(0, io.SEEK_END)
    self._store, self._key = store, key

  def close(self):
    if not self.closed:
      self._store.put(self._key, self.getvalue())
    super().close()


class Backend(epath_backend.Backend):
  """``etils.epath`` backend over :class:`Store` with ``tf.io.gfile``'s GCS semantics."""

  def __init__(self, store: Store):
    self.store = store

  def _isdir(self, key: str) -> bool:
    return bool(self.store.names(key + "/")) or "/" not in key  # a bucket is a folder

  def open(self, path, mode: str):
    key = _key(path)
    if "r" in mode:
      hit = self.store.get(key)
      if hit is None:
        raise FileNotFoundError(path)
      f = io.BytesIO(hit[0])
    else:
      initial = (self.store.get(key) or (b"", 0))[0] if "a" in mode else b""
      f = _Writer(self.store, key, initial)
    return f if "b" in mode else io.TextIOWrapper(f, encoding="utf-8")

  def exists(self, path) -> bool:
    key = _key(path)
    return self.store.get(key) is not None or self._isdir(key)

  def isdir(self, path) -> bool:
    return self._isdir(_key(path))

  def listdir(self, path) -> list[str]:
    key = _key(path)
    if not self._isdir(key):
      raise NotADirectoryError(path)
    return sorted({k[len(key) + 1:].split("/")[0] for k in self.store.names(key + "/")} - {""})

  def glob(self, path) -> list[str]:
    pattern = _key(path)
    keys = set(self.store.names())
    keys |= {k.rsplit("/", i)[0] for k in list(keys) for i in range(1, k.count("/") + 1)}
    return sorted("gs://" + k.rstrip("/") for k in keys if fnmatch.fnmatchcase(k.rstrip("/"), pattern))

  def walk(self, top, *, top_down=True, on_error=None, followlinks=False):
    del on_error, followlinks
    stack = [os.fspath(top).rstrip("/")]
    while stack:
      d = stack.pop()
      names = self.listdir(d)
      dirs = [n for n in names if self.isdir(f"{d}/{n}")]
      yield d, dirs, [n for n in names if n not in dirs]
      stack.extend(f"{d}/{n}" for n in reversed(dirs))

  def makedirs(self, path, *, exist_ok=False, mode=0o777):
    del mode
    key = _key(path)
    if not exist_ok and self.store.get(key) is None and self._isdir(key):
      raise FileExistsError(path)
    self.store.put(key + "/", b"")

  def mkdir(self, path, *, exist_ok=False, mode=0o777):
    self.makedirs(path, exist_ok=exist_ok, mode=mode)

  def rmtree(self, path):
    key = _key(path)
    for k in self.store.names(key + "/"):
      self.store.delete(k)
    self.store.delete(key)

  def remove(self, path):
    if not self.store.delete(_key(path)):
      raise FileNotFoundError(path)

  def rename(self, path, dst):
    dst_key = _key(dst)
    if self.store.get(dst_key) is not None or self.store.names(dst_key + "/"):
      raise FileExistsError(dst)
    self.replace(path, dst)

  def replace(self, path, dst):
    src, dst_key = _key(path), _key(dst)
    moved = [(k, dst_key + k[len(src):]) for k in self.store.names(src) if k == src or k.startswith(src + "/")]
    if not moved:
      raise FileNotFoundError(path)
    for old, new in moved:
      self.store.put(new, self.store.get(old)[0])
      self.store.delete(old)

  def copy(self, path, dst, overwrite: bool):
    if not overwrite and self.exists(dst):
      raise FileExistsError(dst)
    self.store.put(_key(dst), self.store.get(_key(path))[0])

  def stat(self, path):
    hit = self.store.get(_key(path))
    if hit is None and not self.isdir(path):
      raise FileNotFoundError(path)
    return stat_utils.StatResult(is_directory=hit is None, length=len(hit[0]) if hit else 0, mtime=0,
                                 owner=None, group=None, mode=None)


@contextlib.contextmanager
def bucket(monkeypatch):
  """Route this process's ``gs://`` paths to a fresh fake bucket (HTTP for tensorstore, :class:`Backend` for
  ``epath``); yields the :class:`Store`."""
  store = Store()
  server = Server(store)
  monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", server.url)
  monkeypatch.setenv("GOOGLE_AUTH_TOKEN_FOR_TESTING", "fake-token")
  monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)  # google-cloud-storage (Orbax asks for bucket facts)
  monkeypatch.setattr(epath_backend, "tf_backend", Backend(store))
  # TensorBoard's events file is written by TensorFlow's C++ GCS client, whose endpoint is fixed: no double
  # reaches it, so under the fake bucket the scalars are only logged (a real bucket gets the events file).
  from clu import metric_writers
  default_writer = metric_writers.create_default_writer
  monkeypatch.setattr(metric_writers, "create_default_writer", lambda logdir=None, **kw: default_writer(
      logdir, **{**kw, "just_logging": kw.get("just_logging", False) or os.fspath(logdir).startswith("gs://")}))
  try:
    yield store
  finally:
    server.close()
