"""The patch registry: kinds, target selection, reporting, and that every scope restores everything."""
import gc
import json
import sys
import types

import pytest
import torch

from d2export.patching import REGISTRY, Needs, PatchRegistry, Target, has_attrs

torch.set_num_threads(1)


@pytest.fixture
def registry():
    return PatchRegistry()


@pytest.fixture
def fake_package(monkeypatch):
    """A user package `fakepkg` with a module that bound torch.inverse by name and an autograd Function."""
    pkg = types.ModuleType("fakepkg")
    pkg.__path__ = []
    mod = types.ModuleType("fakepkg.layers")
    mod.inverse = torch.inverse  # `from torch import inverse`

    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

    Double.__module__ = "fakepkg.layers"
    mod.Double = Double
    pkg.layers = mod
    monkeypatch.setitem(sys.modules, "fakepkg", pkg)
    monkeypatch.setitem(sys.modules, "fakepkg.layers", mod)
    return mod


def test_needs_matches_targets():
    old = Needs(opsets=(1, 15))
    trt = Needs(runtimes=("tensorrt",), version_below=(8, 5))
    assert old.matches(Target(opset=15)) and not old.matches(Target(opset=16))
    assert trt.matches(Target(17, "tensorrt", (8, 4))) and not trt.matches(Target(17, "tensorrt", (8, 5)))
    assert not trt.matches(Target(17, "tensorrt")), "no version: the current release, which is not below 8.5"
    assert not trt.matches(Target(17, "onnxruntime", (1, 0)))
    with pytest.raises(ValueError):
        Target(runtime="openvino")


def test_function_patch_counts_defers_and_restores(registry):
    original = torch.Tensor.any

    @registry.register("any-dim", function=("torch.any", "torch.Tensor.any"), why="test")
    def any_dim(x, dim=None, keepdim=False):
        return NotImplemented if dim is None else x.sum(dim) > 100

    x = torch.ones(2, 3, dtype=torch.bool)
    with registry.apply() as report:
        assert not x.any(1).any(0)  # both calls give a dim: rewritten (a sum > 100 is False here)
        assert torch.any(x).item()  # no dim: deferred to the original
        assert report["any-dim"].hits == 2 and report["any-dim"].deferred == 1
    assert torch.Tensor.any is original and "any" not in torch.Tensor.__dict__
    assert x.any(1).all()
    assert report["any-dim"].status == "applied" and report["any-dim"].sites == 2


def test_target_only_exclude_and_unused(registry):
    @registry.register("old-opsets", function="torch.cos", when=Needs(opsets=(1, 10)), why="test")
    def cos(x):
        return x

    @registry.register("never-called", function="torch.sin", why="test")
    def sin(x):
        return x

    @registry.register("missing", function="torch.no_such_function", why="test")
    def missing(x):
        return x

    with registry.apply(target=Target(opset=17)) as report:
        assert torch.cos(torch.zeros(1)).item() == 1.0
    assert report["old-opsets"].status == "not-needed"
    assert report["never-called"].status == "unused" and report["never-called"].note == "never called"
    assert report["missing"].status == "unused" and "no_such_function" in report["missing"].note
    with registry.apply(target=Target(opset=9), only=["old-opsets"]) as report:
        assert torch.cos(torch.zeros(1)).item() == 0.0
    assert report["old-opsets"].status == "applied" and report["never-called"].status == "excluded"
    with registry.apply(target=None, exclude=["old-opsets"]) as report:
        assert torch.cos(torch.zeros(1)).item() == 1.0
    assert report.by_status("excluded") == ["old-opsets"]
    with pytest.raises(KeyError, match="typo"):
        with registry.apply(only=["typo"]):
            pass


def test_rebind_catches_names_imported_directly(registry, fake_package):
    @registry.register("inv", function="torch.inverse", why="test")
    def inv(x):
        return x * 0

    a = torch.eye(2) * 2
    with registry.apply() as report:
        assert torch.equal(fake_package.inverse(a), torch.linalg.inv(a)), "not rebound without rebind_in"
    assert report["inv"].status == "unused"
    with registry.apply(rebind_in=["fakepkg"]) as report:
        assert torch.equal(fake_package.inverse(a), torch.zeros(2, 2))
    assert report["inv"].hits == 1 and report["inv"].sites == 2
    assert fake_package.inverse is torch.inverse


def test_static_and_class_methods(registry):
    class Box:
        @staticmethod
        def area(w, h):
            return w * h

        @classmethod
        def name(cls, suffix):
            return cls.__name__ + suffix

    sys.modules[__name__].Box = Box
    try:
        registry.register("area", function=f"{__name__}.Box.area", why="test")(lambda w, h: -1)
        registry.register("name", function=f"{__name__}.Box.name", why="test")(
            lambda cls, suffix: NotImplemented if suffix else "patched")
        with registry.apply() as report:
            assert Box.area(2, 3) == -1 and Box().area(2, 3) == -1
            assert Box.name("") == "patched" and Box.name("!") == "Box!"
        assert report["name"].hits == 1 and report["name"].deferred == 1
        assert Box.area(2, 3) == 6 and Box.name("") == "Box"
        assert isinstance(Box.__dict__["area"], staticmethod) and isinstance(Box.__dict__["name"], classmethod)
    finally:
        del sys.modules[__name__].Box


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.enc_output = torch.nn.Linear(4, 4)
        self.enc_output_norm = torch.nn.LayerNorm(4)

    def forward(self, x):
        return self.proposals(x)

    def proposals(self, x):
        return self.enc_output_norm(self.enc_output(x))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.encoder(x))


class ExportEncoder(Encoder):
    def forward(self, x):
        return self.enc_output(x)


def test_module_method_override_by_duck_typing(registry):
    model = Model()
    x = torch.randn(3, 4)
    before = model(x)

    @registry.register("proposals", module=has_attrs("enc_output", "enc_output_norm"), method="proposals", why="t")
    def proposals(self, x):
        return NotImplemented if x.shape[0] == 1 else self.enc_output(x)

    with registry.apply(model) as report:
        assert torch.allclose(model(x), model.head(model.encoder.enc_output(x)))
        model(x[:1])
        assert report["proposals"].sites == 1 and report["proposals"].hits == 1 and report["proposals"].deferred == 1
    assert "proposals" not in vars(model.encoder) and torch.equal(model(x), before)
    assert type(model.encoder).proposals is Encoder.proposals


def test_module_class_swap_keeps_weights_and_reverts(registry):
    model = Model()
    x = torch.randn(3, 4)
    registry.register("swap", module="Encoder", why="test")(ExportEncoder)
    with registry.apply(model) as report:
        assert type(model.encoder) is ExportEncoder
        assert torch.allclose(model(x), model.head(model.encoder.enc_output(x)))
        model(x)
    assert report["swap"].hits == 2 and type(model.encoder) is Encoder
    assert not model.encoder._forward_pre_hooks
    with registry.apply() as report:  # no model: visible, not silent
        pass
    assert report["swap"].status == "unused" and report["swap"].note == "no model given"


def test_autograd_function_by_path_and_by_predicate(registry, fake_package):
    x = torch.ones(2)
    registry.register("by-path", autograd="fakepkg.layers.Double", why="test")(lambda x: x * 3)
    with registry.apply(only=["by-path"]) as report:
        assert torch.equal(fake_package.Double.apply(x), x * 3)
    assert report["by-path"].hits == 1 and torch.equal(fake_package.Double.apply(x), x * 2)
    assert "apply" not in vars(fake_package.Double)

    gc.collect()  # Double classes of earlier tests' fixtures linger as subclasses until collected
    registry.register("by-duck", autograd=lambda cls: cls.__name__ == "Double" and cls.__module__ == "fakepkg.layers",
                      why="test")(lambda x: NotImplemented)
    with registry.apply(only=["by-duck"]) as report:
        assert torch.equal(fake_package.Double.apply(x), x * 2)
    assert report["by-duck"].sites == 1 and report["by-duck"].deferred == 1


def test_nested_scopes_and_exceptions_restore_everything(registry):
    original = torch.nn.functional.relu
    registry.register("outer", function="torch.nn.functional.relu", why="test")(lambda x, inplace=False: x * 0 + 1)
    inner = PatchRegistry()
    inner.register("inner", function="torch.nn.functional.relu", why="test")(lambda x, inplace=False: NotImplemented)
    x = -torch.ones(2)
    with pytest.raises(RuntimeError, match="boom"):
        with registry.apply() as outer_report:
            with inner.apply() as inner_report:
                assert torch.equal(torch.nn.functional.relu(x), torch.ones(2))  # inner defers to the outer patch
            assert torch.nn.functional.relu is not original
            raise RuntimeError("boom")
    assert torch.nn.functional.relu is original
    assert inner_report["inner"].deferred == 1 and outer_report["outer"].hits == 1


def test_graph_patch_runs_after_export(registry):
    registry.register("count-nodes", graph=True, when=Needs(runtimes=("tensorrt",)), why="test")(
        lambda model: len(model.graph.node))
    fake = types.SimpleNamespace(graph=types.SimpleNamespace(node=[1, 2, 3]))
    with registry.apply(target=Target(17, "tensorrt")) as report:
        pass
    assert report["count-nodes"].note == "not run"
    assert report.run_graph_patches(fake) == 3 and report["count-nodes"].status == "applied"
    with registry.apply(target=Target(17)) as report:
        assert report.run_graph_patches(fake) == 0


def test_report_serialises_and_prints(registry):
    registry.register("cos", function="torch.cos", why="because")(lambda x: x)
    with registry.apply(target=Target(opset=13, runtime="tensorrt", version=(8, 6))) as report:
        torch.cos(torch.zeros(1))
    data = json.loads(json.dumps(report.to_dict()))
    assert data["target"] == {"opset": 13, "runtime": "tensorrt", "version": [8, 6]}
    assert data["patches"] == [{"name": "cos", "kind": "function", "replaces": "torch.cos", "why": "because",
                                "needed_for": "always", "status": "applied", "sites": 1, "hits": 1, "deferred": 0,
                                "note": ""}]
    table = str(report).splitlines()
    assert table[0].split()[:3] == ["patch", "kind", "status"] and table[2].split()[:5] == [
        "cos", "function", "applied", "1", "1"]


def test_register_rejects_ambiguity_and_duplicates(registry):
    with pytest.raises(TypeError):
        registry.register("two", function="torch.cos", module="Linear", why="t")
    registry.register("one", function="torch.cos", why="t")(lambda x: x)
    with pytest.raises(ValueError):
        registry.register("one", function="torch.sin", why="t")(lambda x: x)


def test_builtin_rewrites_registered_with_targets():
    names = {p.name for p in REGISTRY}
    assert {"inverse", "cross", "linalg-cross", "any", "all", "index-assign", "index-put-accumulate",
            "adaptive-avg-pool2d", "adaptive-max-pool2d", "interpolate-bilinear", "group-norm", "grid-sample",
            "shape-gather"} <= names
    needed = lambda target: {p.name for p in REGISTRY if p.name in names and p.needed(target)}  # noqa: E731
    assert {"grid-sample", "inverse"} <= needed(Target(opset=13)) and "grid-sample" not in needed(Target(17))
    assert "grid-sample" in needed(Target(17, "tensorrt", (8, 4)))
    assert {"shape-gather", "group-norm"} <= needed(Target(17, "tensorrt", (8, 0)))
    assert "cross" not in needed(Target(opset=11)) and "cross" in needed(None)


def _user_code(x: torch.Tensor) -> torch.Tensor:
    """Calls a builtin (torch.as_tensor), a Python function (F.adaptive_avg_pool2d) and a boolean-dispatch function
    (F.adaptive_max_pool2d) by name: what TorchScript must resolve while their patches are installed."""
    pooled, where = torch.nn.functional.adaptive_max_pool2d(x, (3, 4), return_indices=True)
    return torch.nn.functional.adaptive_avg_pool2d(x, (3, 4)) + pooled + where + torch.as_tensor([1.5, 2.5]).sum()


def test_torchscript_compiles_the_originals_while_function_patches_are_installed(registry):
    registry.register("as-tensor", function="torch.as_tensor", why="test")(lambda *a, **k: torch.zeros(2))
    registry.register("avg", function="torch.nn.functional.adaptive_avg_pool2d", why="test")(lambda x, s: x * 0)
    registry.register("max", function="torch.nn.functional.adaptive_max_pool2d", why="test")(
        lambda x, s, return_indices=False: NotImplemented)
    x = torch.rand(2, 3, 7, 9)
    with registry.apply() as report:
        scripted = torch.jit.script(_user_code)
        assert torch.equal(torch.as_tensor([1.0]), torch.zeros(2)), "eager calls are still rewritten"
        assert torch.nn.functional.adaptive_avg_pool2d(x, 2).abs().sum() == 0
        in_scope = scripted(x)
    assert report["as-tensor"].hits == 1 and report["avg"].hits == 1
    assert "d2export" not in str(scripted.inlined_graph), "a wrapper was compiled"
    expected = _user_code(x)
    assert torch.equal(in_scope, expected) and torch.equal(scripted(x), expected)


def test_torchscript_builtins_table_is_built_before_anything_is_patched(registry, monkeypatch):
    """torch.jit builds its builtin-operator table lazily from the torch namespace (older torch releases on first
    scripting): built inside a scope it would map a wrapper's id, and lose torch.as_tensor, for good."""
    from torch.jit import _builtins

    monkeypatch.setattr(_builtins, "_builtin_table", None)  # as before torch's first scripting
    monkeypatch.setattr(_builtins, "_builtin_ops", [(f, op) for f, op in _builtins._builtin_ops
                                                    if f not in (torch.as_tensor, torch.inverse)])
    registry.register("as-tensor", function="torch.as_tensor", why="test")(lambda *a, **k: NotImplemented)
    registry.register("inv", function="torch.inverse", why="test")(lambda x: NotImplemented)
    with registry.apply():
        pass
    assert _builtins._find_builtin(torch.as_tensor) == "aten::as_tensor"
    assert _builtins._find_builtin(torch.inverse) == "aten::inverse"


def _pooled(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.adaptive_avg_pool2d(x, (2, 3)) * 2


def test_torchscript_sees_the_original_through_nested_scopes(registry, monkeypatch):
    import weakref

    monkeypatch.setattr(torch.jit._state, "_jit_caching_layer", weakref.WeakKeyDictionary())  # compile afresh
    registry.register("outer", function="torch.nn.functional.adaptive_avg_pool2d", why="test")(lambda x, s: x * 0)
    inner = PatchRegistry()
    inner.register("inner", function="torch.nn.functional.adaptive_avg_pool2d", why="test")(lambda x, s: x * 0)
    x = torch.rand(1, 2, 5, 7)
    with registry.apply(), inner.apply():
        scripted = torch.jit.script(_pooled)
    assert torch.equal(scripted(x), _pooled(x))


def _upsampled(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")


def test_torchscript_keeps_the_overloads_of_a_patched_function(registry):
    """F.interpolate is declared with TorchScript overloads: scripted callers must still pick one of them."""
    registry.register("interp", function="torch.nn.functional.interpolate", why="test")(
        lambda *a, **k: NotImplemented)
    x = torch.rand(1, 2, 3, 5)
    with registry.apply():
        scripted = torch.jit.script(_upsampled)
    assert torch.equal(scripted(x), _upsampled(x))


def test_calls_a_replacement_cannot_take_go_to_the_original():
    """The built-in rewrites take the common argument forms; the originals' other keyword names and `out=` must
    still work inside a scope, as without the plugin."""
    from d2export.patching import apply_patches

    a = torch.eye(3) * 2 + 0.1
    x, src, idx = torch.zeros(4, 3), torch.ones(2, 3), torch.tensor([1, 1])
    expected_sum = torch.index_add(x, 0, idx, src)
    with apply_patches(target=Target(17)) as report:
        assert torch.equal(torch.linalg.inv(A=a), torch._C._linalg.linalg_inv(a))
        buf = torch.empty(4, 3)
        torch.index_add(x, 0, idx, src, out=buf)
        assert torch.equal(buf, expected_sum)
        assert torch.equal(torch.index_add(x, 0, idx, src), expected_sum)  # rewritten: repeated indices add up
    assert report["inverse"].deferred == 1 and report["index-add"].deferred == 1 and report["index-add"].hits == 1
