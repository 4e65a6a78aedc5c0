"""Making the graph: capture through TorchScript or torch.export, the ONNX file written atomically, reduced
precisions (float16, int8), lint for sizes baked in. Verification (../verification/) then holds it to eager."""
