"""A zoo model with MOON's projection head between its body and its output
layer.

MOON (Li, He and Song, "Model-Contrastive Federated Learning", CVPR 2021,
Section 3.2) builds its network from three parts: the base encoder, a
projection head (a two-layer MLP with output dimension 256) and the output
layer, which classifies the projection. The representation the
contrastive loss compares is the projection. As in the authors' code, the
MLP is Dense(D) → ReLU → Dense(P) with D the encoder's representation size
(the input of the zoo model's own last layer, which is dropped) and P the
projection dimension; the output layer is Dense(C) on the projection.

`with_projection(model, P)` wraps any zoo model. The wrapped module follows
the zoo's split convention (`features_only=True` returns the projection,
`from_features=True` applies the output layer alone), so
`Model.apply_train_features` gives the logits and the projection from one
forward pass. Parameters: `{'encoder': <the zoo model's body>,
'projection_1', 'projection_2', 'head'}`; BatchNorm statistics, if any,
under 'encoder' in their own collection.
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fedjax_mr.models import model as model_lib


class Projected(nn.Module):
  """encoder body → Dense(D) → ReLU → Dense(P) [the representation] →
  Dense(C)."""

  encoder: nn.Module
  projection_dim: int
  num_classes: int

  @nn.compact
  def __call__(
    self,
    x: jax.Array,
    train: bool = False,
    mask: jax.Array | None = None,
    *,
    features_only: bool = False,
    from_features: bool = False,
  ) -> jax.Array:
    if not from_features:
      h = self.encoder(x, train=train, mask=mask, features_only=True)
      h = nn.relu(nn.Dense(h.shape[-1], name='projection_1')(h))
      x = nn.Dense(self.projection_dim, name='projection_2')(h)
      if features_only:
        return x
    return nn.Dense(self.num_classes, name='head')(x)


def with_projection(
  model: model_lib.Model, projection_dim: int = 256
) -> model_lib.Model:
  """`model` with MOON's projection head (see the module docstring).

  Args:
    model: a zoo model (its module takes `features_only=`).
    projection_dim: P, the projection's size (MOON: 256).

  Returns:
    A `Model` named `<name>+proj<P>` with the same inputs and classes.
  """
  p = int(projection_dim)
  if p < 1:
    raise ValueError(f'projection_dim must be >= 1, got {projection_dim}')
  module = Projected(
    encoder=model.module.clone(parent=None, name='encoder'),
    projection_dim=p,
    num_classes=model.num_classes,
  )
  return model._replace(name=f'{model.name}+proj{p}', module=module)
