"""Bundled ImageNet-1K → dataset label maps for FedStitch's ImageNet pool.

FedStitch keeps each pool network's ImageNet head and "aligned ImageNet-1K
labels" to CIFAR-10, CIFAR-100 and CINIC-10 without saying how. A label
map lists, for each dataset class, the ImageNet classes that count as it
(`fedjax_mr.stitch.network.map_labels` scores a class by the max, or sum,
of their logits). We bundle the map for the ten CIFAR-10 classes, which
CINIC-10 shares in the same order; CIFAR-100's classes have no clean
ImageNet counterparts, so it takes a map of the user's own
(`label_map=<file.json>`).

How the CIFAR-10 map was chosen (our reading; ImageNet ids in torchvision's
class order, i.e. the sorted WordNet ids, with their names below):

* every ImageNet class that is an instance of the CIFAR class: the birds
  (7–24, 80–100, 127–146), the domestic cats (281–285), the dogs (151–268),
  the frogs (30–32);
* for the vehicles, the kinds CIFAR-10's own class descriptions name:
  fixed-wing aircraft (not airships or the space shuttle); cars, estates,
  SUVs and minivans for automobile; big trucks for truck (a moving van is a
  box truck; the police van and the ambulance are left out); neither takes
  the pickup, which CIFAR-10 puts in neither class; boats and ships;
* ImageNet-1K has no deer: the antelope-like hartebeest, impala and gazelle
  stand in for it; horse is the sorrel and the horse cart.

No ImageNet class counts for two dataset classes.
"""

from __future__ import annotations

from collections.abc import Sequence

# Dataset class → ImageNet-1K class ids (torchvision's order).
CIFAR10: tuple[tuple[int, ...], ...] = (
  # airplane: airliner, warplane, wing
  (404, 895, 908),
  # automobile: beach wagon, cab, convertible, jeep, limousine, minivan,
  # Model T, racer, sports car
  (436, 468, 511, 609, 627, 656, 661, 751, 817),
  # bird: cock … great grey owl, black grouse … black swan, white stork …
  # albatross
  tuple(range(7, 25)) + tuple(range(80, 101)) + tuple(range(127, 147)),
  # cat: tabby, tiger cat, Persian, Siamese, Egyptian cat
  tuple(range(281, 286)),
  # deer (none in ImageNet-1K): hartebeest, impala, gazelle
  (351, 352, 353),
  # dog: Chihuahua … Mexican hairless
  tuple(range(151, 269)),
  # frog: bullfrog, tree frog, tailed frog
  (30, 31, 32),
  # horse: sorrel, horse cart
  (339, 603),
  # ship: aircraft carrier, canoe, catamaran, container ship, fireboat,
  # gondola, lifeboat, liner, pirate ship, schooner, speedboat, submarine,
  # trimaran, wreck, yawl
  (403, 472, 484, 510, 554, 576, 625, 628, 724, 780, 814, 833, 871, 913, 914),
  # truck: fire engine, garbage truck, moving van, tow truck, trailer truck
  (555, 569, 675, 864, 867),
)

# Bundled maps by dataset name (`label_map=<name>`, or the default of
# experiments.stitch with an `imagenet_pool` on these datasets).
BUNDLED: dict[str, tuple[tuple[int, ...], ...]] = {
  'cifar10': CIFAR10,
  'cinic10': CIFAR10,
}


def bundled(name: str) -> list[list[int]] | None:
  """The bundled map called `name` as lists, or None if there is none."""
  table: Sequence[Sequence[int]] | None = BUNDLED.get(name)
  return None if table is None else [list(ids) for ids in table]
