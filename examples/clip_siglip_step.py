"""A CLIP / SigLIP training loop with open_clip's losses swapped for the fused ones: one import.

Two small towers (an "image" MLP and a "text" MLP) on random paired data, a learnable logit scale (and,
for SigLIP, bias), features L2-normalised by the model as open_clip's models do. Runs on the CPU in a
few seconds:

    python examples/clip_siglip_step.py --loss siglip --steps 30 --batch 256
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

# from open_clip.loss import ClipLoss, SigLipLoss          # before
from fused_contrastive.integrations.open_clip import ClipLoss, SigLipLoss  # after: the only change


class TwoTowers(nn.Module):
    def __init__(self, d_img: int, d_txt: int, d: int, siglip: bool):
        super().__init__()
        self.image = nn.Sequential(nn.Linear(d_img, 128), nn.GELU(), nn.Linear(128, d))
        self.text = nn.Sequential(nn.Linear(d_txt, 128), nn.GELU(), nn.Linear(128, d))
        # open_clip's initialisations: CLIP log(1 / 0.07); SigLIP log(10) and bias -10
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0) if siglip else math.log(1 / 0.07)))
        self.logit_bias = nn.Parameter(torch.tensor(-10.0)) if siglip else None

    def forward(self, img, txt):
        return F.normalize(self.image(img), dim=-1), F.normalize(self.text(txt), dim=-1)


def main(argv=None) -> list[float]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--loss", choices=("clip", "siglip"), default="clip")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    siglip = args.loss == "siglip"
    # paired data: the text view is a fixed linear map of the image view plus noise
    mix = torch.randn(64, 48) / 8
    model = TwoTowers(64, 48, 32, siglip)
    loss_fn = SigLipLoss() if siglip else ClipLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(args.steps):
        img = torch.randn(args.batch, 64)
        txt = img @ mix + 0.1 * torch.randn(args.batch, 48)
        img_f, txt_f = model(img, txt)
        scale = model.logit_scale.exp()
        loss = loss_fn(img_f, txt_f, scale, model.logit_bias) if siglip else loss_fn(img_f, txt_f, scale)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  {args.loss} loss {loss.item():.4f}  scale {scale.item():.2f}")
    return losses


if __name__ == "__main__":
    main()
