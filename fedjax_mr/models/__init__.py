"""Model zoo: `get(name, num_classes, input_shape)` returns a `Model`."""

from fedjax_mr.models import cnn as cnn
from fedjax_mr.models import imagenet as imagenet
from fedjax_mr.models import layers as layers
from fedjax_mr.models import lstm as lstm
from fedjax_mr.models import resnet as resnet
from fedjax_mr.models import vgg as vgg
from fedjax_mr.models.model import NAMES as NAMES
from fedjax_mr.models.model import Model as Model
from fedjax_mr.models.model import get as get
