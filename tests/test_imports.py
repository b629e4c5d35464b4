"""The package's import graph (every ``import`` statement, function-level ones included, read from the source):
no circle, and no arrow from the algorithm, model, data or checkpoint code back into ``jobs/`` (jobs use them,
never the other way round)."""
import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parents[1] / "margrpo_jax"
BELOW_JOBS = ("margrpo_jax.rl", "margrpo_jax.models", "margrpo_jax.data", "margrpo_jax.checkpoint")


def _modules() -> dict[str, pathlib.Path]:
  out = {}
  for f in PKG.rglob("*.py"):
    parts = f.relative_to(PKG.parent).with_suffix("").parts
    out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
  return out


def _graph() -> dict[str, set[str]]:
  mods = _modules()

  def known(name: str) -> str | None:  # the module a dotted name lives in (a module, or a name inside one)
    while name and name not in mods:
      name = name.rpartition(".")[0]
    return name or None

  graph = {}
  for mod, f in mods.items():
    package = mod if f.name == "__init__.py" else mod.rpartition(".")[0]
    deps = set()
    for node in ast.walk(ast.parse(f.read_text())):
      if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
      elif isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
          up = package.split(".")[:len(package.split(".")) - node.level + 1]
          base = ".".join(up + ([base] if base else []))
        names = [f"{base}.{a.name}" for a in node.names]
      else:
        continue
      deps |= {m for m in map(known, names) if m and m != mod}
    graph[mod] = deps
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components with more than one module (Tarjan)."""
  index, low, stack, on, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while not comp or comp[-1] != v:
        comp.append(stack.pop())
        on.discard(comp[-1])
      if len(comp) > 1:
        out.append(sorted(comp))

  for v in graph:
    if v not in index:
      visit(v)
  return out


def test_the_graph_is_read():  # relative, absolute and function-level imports all seen
  graph = _graph()
  assert {"margrpo_jax.rl.step", "margrpo_jax.validate"} <= graph["margrpo_jax.jobs.rl"]


def test_no_import_circle():
  assert _cycles(_graph()) == []


def test_nothing_below_the_jobs_imports_a_job():
  back = sorted((m, d) for m, deps in _graph().items() for d in deps
                if d.startswith("margrpo_jax.jobs") and m.startswith(BELOW_JOBS))
  assert back == []
