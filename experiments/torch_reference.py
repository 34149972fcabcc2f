"""The loop a user would otherwise write: FedAvg rounds in plain PyTorch.

`experiments.benchmark` times fedjax_mr's round against this on the same
clients, model, batch size, local epochs and thread count. It is the
strongest plain version of that loop: the whole training set sits on the
device as one normalised float32 tensor, each client's batches are index
slices of it (no DataLoader), one model object is reloaded with the global
weights per client, a fresh `torch.optim.SGD` (momentum buffer at zero) per
client and round, and the server averages the state dicts weighted by
client sizes (BatchNorm running statistics included, as fedjax_mr does).
A client of n examples takes E × ceil(n / B) steps, the last batch of each
epoch partial, exactly like fedjax_mr's clients.

PyTorch is the optional `bench` extra (`pip install -e .[bench]`); nothing
in the library imports it.

The models mirror fedjax_mr's (`fedjax_mr.models.cnn.CNNMnist` and
`CNNCifar`, `fedjax_mr.models.resnet.ResNet20`,
`fedjax_mr.models.vgg.VGG16`) layer for layer in NCHW; their parameter
counts are checked against the JAX models in the benchmark (and in
tests/test_torch_reference.py where PyTorch is installed).
"""

from __future__ import annotations

import os
import time
from typing import Sequence

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F


class CNNMnist(nn.Module):
  """conv5×5(20) pool ReLU, conv5×5(50) pool ReLU, fc50 ReLU, fc(C)."""

  def __init__(self, in_ch: int, hw: int, num_classes: int):
    super().__init__()
    self.conv1 = nn.Conv2d(in_ch, 20, 5)
    self.conv2 = nn.Conv2d(20, 50, 5)
    side = ((hw - 4) // 2 - 4) // 2
    self.fc1 = nn.Linear(50 * side * side, 50)
    self.fc2 = nn.Linear(50, num_classes)

  def forward(self, x):
    x = F.relu(F.max_pool2d(self.conv1(x), 2))
    x = F.relu(F.max_pool2d(self.conv2(x), 2))
    x = F.relu(self.fc1(x.flatten(1)))
    return self.fc2(x)


class CNNCifar(nn.Module):
  """conv5×5(6) ReLU pool, conv5×5(16) ReLU pool, fc120 ReLU, fc84 ReLU,
  fc(C)."""

  def __init__(self, in_ch: int, hw: int, num_classes: int):
    super().__init__()
    self.conv1 = nn.Conv2d(in_ch, 6, 5)
    self.conv2 = nn.Conv2d(6, 16, 5)
    side = ((hw - 4) // 2 - 4) // 2
    self.fc1 = nn.Linear(16 * side * side, 120)
    self.fc2 = nn.Linear(120, 84)
    self.fc3 = nn.Linear(84, num_classes)

  def forward(self, x):
    x = F.max_pool2d(F.relu(self.conv1(x)), 2)
    x = F.max_pool2d(F.relu(self.conv2(x)), 2)
    x = F.relu(self.fc1(x.flatten(1)))
    return self.fc3(F.relu(self.fc2(x)))


class _Bottleneck(nn.Module):
  def __init__(self, in_ch: int, planes: int, stride: int):
    super().__init__()
    out_ch = 4 * planes
    self.bn1 = nn.BatchNorm2d(in_ch)
    self.conv1 = nn.Conv2d(in_ch, planes, 1, bias=False)
    self.bn2 = nn.BatchNorm2d(planes)
    self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
    self.bn3 = nn.BatchNorm2d(planes)
    self.conv3 = nn.Conv2d(planes, out_ch, 1, bias=False)
    self.shortcut = None
    if stride != 1 or in_ch != out_ch:
      self.shortcut = nn.Conv2d(in_ch, out_ch, 1, stride, bias=False)

  def forward(self, x):
    pre = F.relu(self.bn1(x))
    h = self.conv1(pre)
    h = self.conv2(F.relu(self.bn2(h)))
    h = self.conv3(F.relu(self.bn3(h)))
    return h + (x if self.shortcut is None else self.shortcut(pre))


class ResNet20(nn.Module):
  """The FedMR papers' pre-activation bottleneck "ResNet-20"."""

  def __init__(self, in_ch: int, hw: int, num_classes: int):
    super().__init__()
    del hw
    self.conv1 = nn.Conv2d(in_ch, 16, 3, 1, 1, bias=False)
    blocks, ch = [], 16
    for planes, stride in ((16, 1), (32, 2), (64, 2)):
      for j in range(2):
        blocks.append(_Bottleneck(ch, planes, stride if j == 0 else 1))
        ch = 4 * planes
    self.blocks = nn.Sequential(*blocks)
    self.linear = nn.Linear(ch, num_classes)

  def forward(self, x):
    x = self.blocks(self.conv1(x))
    return self.linear(x.mean(dim=(2, 3)))


# As `fedjax_mr.models.vgg.VGG16_PATTERN`: output channels, 'M' a pool.
VGG16_PATTERN = (
  64, 64, 'M', 128, 128, 'M', 256, 256, 256, 'M',
  512, 512, 512, 'M', 512, 512, 512, 'M',
)  # fmt: skip


class VGG16(nn.Module):
  """13 × [conv3×3 (padding 1, bias) BatchNorm ReLU] with 2×2 max-pools
  (ceil mode, as ours for odd maps), a global max over what is left (the
  identity on the 1×1 map of 32×32 inputs), then 512 → 4096 → 4096 → C
  with ReLU and Dropout(0.5): `fedjax_mr.models.vgg.VGG16`."""

  def __init__(self, in_ch: int, hw: int, num_classes: int):
    super().__init__()
    del hw
    layers, ch = [], in_ch
    for v in VGG16_PATTERN:
      if v == 'M':
        layers.append(nn.MaxPool2d(2, 2, ceil_mode=True))
        continue
      layers += [nn.Conv2d(ch, v, 3, padding=1), nn.BatchNorm2d(v), nn.ReLU()]
      ch = v
    self.features = nn.Sequential(*layers)
    self.classifier = nn.Sequential(
      nn.Linear(ch, 4096),
      nn.ReLU(),
      nn.Dropout(0.5),
      nn.Linear(4096, 4096),
      nn.ReLU(),
      nn.Dropout(0.5),
      nn.Linear(4096, num_classes),
    )

  def forward(self, x):
    x = self.features(x).amax(dim=(2, 3))
    return self.classifier(x)


MODELS = {
  'cnn_mnist': CNNMnist,
  'cnn_cifar': CNNCifar,
  'resnet20': ResNet20,
  'vgg16': VGG16,
}


def set_tf32(allow: bool) -> str:
  """Allows (or forbids) TF32 in PyTorch's CUDA float32 matrix products and
  cuDNN convolutions; returns a line stating the settings before and
  after (PyTorch's own defaults: products False, cuDNN True)."""
  before = _tf32_settings()
  torch.backends.cuda.matmul.allow_tf32 = allow
  torch.backends.cudnn.allow_tf32 = allow
  return f'PyTorch TF32: {_tf32_settings()} (before: {before})'


def _tf32_settings() -> str:
  return (
    f'matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32}, '
    f'cudnn.allow_tf32={torch.backends.cudnn.allow_tf32}'
  )


def num_parameters(module: nn.Module) -> int:
  return sum(p.numel() for p in module.parameters())


def load_flax_cnn_mnist(module: CNNMnist, params) -> None:
  """Copies fedjax_mr's `cnn_mnist` parameters (`variables['params']`) into
  `module`: HWIO kernels to OIHW, dense kernels transposed, and the first
  dense layer's inputs reordered from NHWC to NCHW flattening."""

  def t(a):
    return torch.from_numpy(np.array(a, np.float32))

  sd = {
    'conv1.weight': t(params['Conv_0']['kernel']).permute(3, 2, 0, 1),
    'conv1.bias': t(params['Conv_0']['bias']),
    'conv2.weight': t(params['Conv_1']['kernel']).permute(3, 2, 0, 1),
    'conv2.bias': t(params['Conv_1']['bias']),
    'fc2.weight': t(params['Dense_1']['kernel']).T,
    'fc2.bias': t(params['Dense_1']['bias']),
    'fc1.bias': t(params['Dense_0']['bias']),
  }
  k = t(params['Dense_0']['kernel'])  # [(h, w, c), out]
  side = int(round((k.shape[0] // module.conv2.out_channels) ** 0.5))
  c = module.conv2.out_channels
  sd['fc1.weight'] = (
    k.reshape(side, side, c, -1).permute(3, 2, 0, 1).reshape(k.shape[1], -1)
  )
  module.load_state_dict({k: v.contiguous() for k, v in sd.items()})


class FedAvgLoop:
  """FedAvg rounds of plain per-client PyTorch training.

  Args:
    model_name: a key of `MODELS`.
    x: `[M, H, W, C]` training images (storage dtype, NHWC as fedjax_mr
      holds them).
    y: `[M]` labels.
    parts: client k's example indices.
    scale, shift: the model input is `x * scale + shift`.
    num_classes: C.
    local_epochs, batch_size, lr, momentum: local SGD.
    device: 'cpu' or 'cuda'.
    threads: intra-op threads on the CPU (the same count fedjax_mr uses).
    compute_dtype: 'float32', or 'bfloat16': the forward pass and loss under
      `torch.autocast` in bfloat16, float32 weights (fedjax_mr's
      `compute_dtype='bfloat16'` policy).
  """

  def __init__(
    self,
    model_name: str,
    x: np.ndarray,
    y: np.ndarray,
    parts: Sequence[np.ndarray],
    scale: float,
    shift: float,
    num_classes: int,
    local_epochs: int,
    batch_size: int,
    lr: float,
    momentum: float,
    device: str,
    threads: int,
    compute_dtype: str = 'float32',
  ):
    self.autocast = compute_dtype == 'bfloat16'
    if device == 'cpu':
      torch.set_num_threads(threads)
    self.device = torch.device(device)
    images = torch.from_numpy(np.ascontiguousarray(x)).to(self.device)
    self.x = (images.float() * scale + shift).permute(0, 3, 1, 2).contiguous()
    self.y = torch.from_numpy(np.asarray(y, np.int64)).to(self.device)
    self.parts = [
      torch.from_numpy(np.asarray(p, np.int64)).to(self.device) for p in parts
    ]
    self.model = MODELS[model_name](
      self.x.shape[1], self.x.shape[2], num_classes
    ).to(self.device)
    self.model.train()
    self.state = {
      k: v.detach().clone() for k, v in self.model.state_dict().items()
    }
    self.epochs, self.b = local_epochs, batch_size
    self.lr, self.momentum = lr, momentum
    self.generator = torch.Generator(device=self.device)
    self.generator.manual_seed(0)

  def set_global(self, module_state: dict) -> None:
    """Sets the global model (a state dict of `self.model`)."""
    self.state = {k: v.detach().clone() for k, v in module_state.items()}

  def _train_client(self, idx: torch.Tensor) -> int:
    self.model.load_state_dict(self.state)
    opt = torch.optim.SGD(
      self.model.parameters(), lr=self.lr, momentum=self.momentum
    )
    n, steps = len(idx), 0
    for _ in range(self.epochs):
      order = idx[
        torch.randperm(n, device=self.device, generator=self.generator)
      ]
      for s in range(0, n, self.b):
        batch = order[s : s + self.b]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(
          self.device.type, torch.bfloat16, enabled=self.autocast
        ):
          logits = self.model(self.x[batch])
        loss = F.cross_entropy(logits.float(), self.y[batch])
        loss.backward()
        opt.step()
        steps += 1
    return steps

  def round(self, client_ids: Sequence[int]) -> tuple[float, int]:
    """One FedAvg round on these clients; returns (seconds, local steps)."""
    self._sync()
    t = time.perf_counter()
    total, steps = None, 0
    weight_sum = 0
    for cid in client_ids:
      idx = self.parts[int(cid)]
      steps += self._train_client(idx)
      w = len(idx)
      weight_sum += w
      sd = self.model.state_dict()
      if total is None:
        total = {k: v.detach().float() * w for k, v in sd.items()}
      else:
        for k, v in sd.items():
          total[k] += v.detach().float() * w
    self.state = {
      k: (v / weight_sum).to(self.state[k].dtype) for k, v in total.items()
    }
    self._sync()
    return time.perf_counter() - t, steps

  def _sync(self):
    if self.device.type == 'cuda':
      torch.cuda.synchronize()


def bench_loop(
  setting, dataset, partition, num_params: int, device: str
) -> tuple[FedAvgLoop | None, str]:
  """The loop `fedjax_mr.bench.measure` times beside a round: a
  `FedAvgLoop` of the benchmark `setting` on `dataset` split by
  `partition` (SGD at 0.01, momentum 0.9, as the round), on `device`
  ('cpu' or 'cuda'), and the line saying its TF32 settings; or None and a
  line saying there is no such model here. Raises RuntimeError if the
  model's parameters do not number `num_params`, the JAX model's."""
  if setting.model not in MODELS:
    return None, (
      f'PyTorch reference: none for {setting.model} (it has '
      f'{", ".join(MODELS)})'
    )
  loop = FedAvgLoop(
    setting.model,
    dataset.x_train,
    dataset.y_train,
    partition,
    dataset.scale,
    dataset.shift,
    dataset.num_classes,
    setting.local_epochs,
    setting.batch_size,
    0.01,
    0.9,
    device,
    setting.threads or os.cpu_count(),
    setting.compute_dtype,
  )
  # JAX's default float32 products use TF32 on NVIDIA GPUs: the same here.
  line = set_tf32(setting.matmul_precision == 'default')
  theirs = num_parameters(loop.model)
  if num_params != theirs:
    raise RuntimeError(
      f'the PyTorch {setting.model} has {theirs} parameters, ours {num_params}'
    )
  return loop, line
