import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """`num_layers` linear layers with ReLU between them (the box head)."""

    def __init__(self, input_dim, hidden_dim, output_dim, num_layers):
        super().__init__()
        self.num_layers = num_layers
        dims = [input_dim] + [hidden_dim] * (num_layers - 1)
        self.layers = nn.ModuleList(nn.Linear(i, o) for i, o in zip(dims, dims[1:] + [output_dim]))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = layer(x) if i == self.num_layers - 1 else F.relu(layer(x))
        return x


class FFN(nn.Module):
    """Linear → activation → dropout (× num_fcs − 1) → linear → dropout, plus the identity."""

    def __init__(self, embed_dim=256, feedforward_dim=1024, output_dim=None, num_fcs=2, activation=None,
                 ffn_drop=0.0, add_identity=True):
        super().__init__()
        output_dim = output_dim or embed_dim
        layers, width = [], embed_dim
        for _ in range(num_fcs - 1):
            layers += [nn.Linear(width, feedforward_dim), activation or nn.ReLU(inplace=True), nn.Dropout(ffn_drop)]
            width = feedforward_dim
        layers += [nn.Linear(width, output_dim), nn.Dropout(ffn_drop)]
        self.layers = nn.Sequential(*layers)
        self.add_identity = add_identity

    def forward(self, x, identity=None):
        out = self.layers(x)
        if not self.add_identity:
            return out
        return (x if identity is None else identity) + out
