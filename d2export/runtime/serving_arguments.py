"""The command-line options every serving command shares (infer, serve, batch) and the Predictor they describe."""
from __future__ import annotations

from d2export.runtime.predictor import Predictor


def add_predictor_arguments(ap) -> None:
    """The command-line options every serving command shares (argparse)."""
    ap.add_argument("model", help="the exported .onnx (its manifest lies beside it)")
    ap.add_argument("--providers", default="cpu", help="comma-separated: cpu, cuda, tensorrt (in priority order)")
    ap.add_argument("--tf32", action="store_true",
                    help="cuda: let onnxruntime compute in TF32 (faster on Ampere and later, but not what the export "
                         "verified: near-tied detections may change)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="cuda: replay CUDA graphs (one per batch and size) where onnxruntime accepts the graph "
                         "(a fixed-size export: export.dynamic=false); otherwise serves without, saying why")
    ap.add_argument("--threads", type=int, default=0, help="onnxruntime intra-op threads (0: one per core)")
    ap.add_argument("--score-threshold", type=float, default=None, help="lowest score kept (default: the manifest's)")
    ap.add_argument("--min-size", type=int, default=None, help="shortest edge to resize to (default: the manifest's)")
    ap.add_argument("--max-size", type=int, default=None, help="longest edge cap (default: the manifest's)")
    ap.add_argument("--no-verify-hash", action="store_true",
                    help="skip checking the model's sha256 against its manifest (huge files); inputs and outputs "
                         "are still checked")
    ap.add_argument("--embedded-manifest", action="store_true",
                    help="serve a model.onnx that has no manifest beside it from the copy inside it (without this, "
                         "a lone model is refused as what an interrupted export leaves)")


def predictor_from_args(args) -> Predictor:
    return Predictor(args.model, args.providers.split(","), args.threads, args.score_threshold,
                     min_size=args.min_size, max_size=args.max_size, verify_hash=not args.no_verify_hash,
                     embedded_manifest=args.embedded_manifest, tf32=args.tf32,
                     cuda_graph=getattr(args, "cuda_graph", False))
