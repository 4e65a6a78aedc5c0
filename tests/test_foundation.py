"""The set-up's promises: detectron2 installed as a real distribution, pure Python, building models on the CPU."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import subprocess
import sys


def test_detectron2_is_a_known_distribution_without_compiled_parts():
    dist = importlib.metadata.distribution("detectron2")
    files = [str(f) for f in dist.files]
    assert any(f.endswith("detectron2/modeling/meta_arch/rcnn.py") for f in files)
    if dist.version.endswith("+purepy"):  # installed by scripts/install_detectron2.py (a user's own build may differ)
        assert not any(f.endswith(".so") for f in files)
        assert not any(f.startswith("tools/") for f in files)
    out = subprocess.run([sys.executable, "-m", "pip", "show", "detectron2"], capture_output=True, text=True)
    assert out.returncode == 0 and "Name: detectron2" in out.stdout


def test_model_zoo_config_resolves_without_pkg_resources():
    from detectron2 import model_zoo

    path = model_zoo.get_config_file("COCO-Detection/faster_rcnn_R_50_FPN_1x.yaml")
    assert path.endswith("faster_rcnn_R_50_FPN_1x.yaml")


def test_detectron2_builds_and_runs_rcnn_on_cpu():
    import torch
    from detectron2 import model_zoo
    from detectron2.config import get_cfg
    from detectron2.modeling import build_model

    cfg = get_cfg()
    cfg.merge_from_file(model_zoo.get_config_file("COCO-Detection/faster_rcnn_R_50_FPN_1x.yaml"))
    cfg.MODEL.DEVICE = "cpu"
    cfg.MODEL.RESNETS.DEPTH, cfg.MODEL.RESNETS.RES2_OUT_CHANNELS = 18, 64
    model = build_model(cfg).eval()
    with torch.no_grad():
        out = model([{"image": torch.rand(3, 96, 128) * 255}])
    assert out[0]["instances"].image_size == (96, 128)


def test_runtime_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None; sys.modules['detectron2'] = None; import d2export, "
            "d2export.manifest, d2export.resizing, d2export.charset, d2export.runtime, d2export.runtime.predictor, "
            "d2export.runtime.visualize, d2export.families._text")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_the_cpu_is_described_by_model_and_the_features_speed_depends_on(tmp_path, monkeypatch):
    from d2export import cpu

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some Xeon\nflags\t\t: fpu avx2 avx512f avx512_vnni amx_tile "
                    "amx_int8\n\nprocessor\t: 1\nmodel name\t: Some Xeon\nflags\t\t: fpu\n")
    monkeypatch.setattr(cpu, "CPUINFO", info)
    assert cpu.cpu_features() == ["avx2", "avx512f", "avx512_vnni", "amx_tile", "amx_int8"]
    assert cpu.describe_cpu().startswith("Some Xeon, ") and cpu.describe_cpu().endswith(
        "avx2 avx512f avx512_vnni amx_tile amx_int8")
    info.write_text("processor\t: 0\nmodel name\t: Old Core\nflags\t\t: fpu sse2\n")
    assert cpu.cpu_features() == [] and "none of avx2/" in cpu.describe_cpu()
    monkeypatch.setattr(cpu, "CPUINFO", tmp_path / "absent")
    assert cpu.cpu_features() == [] and cpu.describe_cpu()  # no /proc: the platform's name
