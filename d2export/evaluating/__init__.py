"""`d2export evaluate`: a dataset's metrics under PyTorch and under each exported model, side by side. Text metrics
(`text_metrics`) are plain numpy and shapely; the rest builds on detectron2's evaluation API."""
