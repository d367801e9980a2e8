"""What the papers report, in one place: the figures the study's and the published weights' tables set beside ours."""

# top-1 gain over the dense twin (points): the SSoG abstract (CIFAR-100 at 224 px) per depth setting for the fixed
# kernels; 4rtemi5/ssog's ImageNet-1k table (widths 256 and 384) for the steered ones
PAPER_GAIN = {'discrete': (2.2, 4.1), 'looped': (5.4, 8.1), 'ode': (2.2, 4.1), 'steered': (0.2, 0.9)}
# steered minus fixed kernels (points): 4rtemi5/ssog's ImageNet-1k table puts the fixed field about 2 points below
PAPER_STEER_GAIN = 2.0
# ODE-ViT: a teacher-guided ODE-ViT gains more than 10 points over the free one (CIFAR-100, 300 epochs)
PAPER_GUIDANCE_GAIN = 10.0
