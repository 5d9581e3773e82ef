"""The network: the paper's ViT, its ResNet stem (the hybrid), masked patch prediction, tasks, FLOPs."""
