"""The loss terms of trajectory distillation, each a plain function of tensors."""
import torch
import torch.nn.functional as F

__all__ = ['STATE_NORMS', 'state_matching_loss', 'cls_attention_loss', 'logit_kd_loss', 'jasmin_loss', 'jasmin_g']


STATE_NORMS = ('none', 'layernorm', 'cosine', 'standardize', 'gram')


def state_matching_loss(student: torch.Tensor, teacher: torch.Tensor, norm: str = 'none') -> torch.Tensor:
    """Sum over targets of the distance between matched states [K, B, ..., D] (ODE-ViT sums its CLS MSEs).

    ``norm`` says what is compared, because raw teacher states can be far larger than the student's (an MSE near 74
    against a label loss near 1.6 in our first runs) and would drown the label loss:
    'none' the raw MSE (the paper); 'layernorm' the MSE of both states after a per-token LayerNorm without affine
    parameters (scale- and shift-free); 'cosine' 1 - cosine similarity per token; 'standardize' the MSE after
    standardising both by the teacher's per-dimension mean and std at that target (over batch and tokens);
    'gram' the MSE between the two batches' similarity matrices (similarity-preserving KD, Tung & Mori 2019): per
    token position, the cosine similarity of every pair of images' states, centred over the batch. 'gram' is the
    only one of these distances that any rotation of the student's state space leaves unchanged, so a student that
    already has a trained trajectory is asked to relate images as the teacher does, not to turn its states into the
    teacher's basis (the other distances start near their maximum for a trained student whose states are orthogonal
    to the teacher's).
    """
    if student.shape != teacher.shape:
        raise ValueError(f'State shapes differ: student {tuple(student.shape)}, teacher {tuple(teacher.shape)}.')
    if norm not in STATE_NORMS:
        raise ValueError(f'state norm must be one of {STATE_NORMS}, got {norm!r}.')
    if norm == 'gram':
        student, teacher = _batch_similarity(student), _batch_similarity(teacher)
        return F.mse_loss(student, teacher, reduction='none').flatten(1).mean(1).sum()
    if norm == 'cosine':
        return (1 - F.cosine_similarity(student, teacher, dim=-1)).flatten(1).mean(1).sum()
    if norm == 'layernorm':
        student = F.layer_norm(student, student.shape[-1:])
        teacher = F.layer_norm(teacher, teacher.shape[-1:])
    elif norm == 'standardize':
        dims = tuple(range(1, teacher.ndim - 1))
        mean = teacher.mean(dim=dims, keepdim=True)
        std = teacher.std(dim=dims, keepdim=True).clamp_min(1e-6)
        student, teacher = (student - mean) / std, (teacher - mean) / std
    return F.mse_loss(student, teacher, reduction='none').flatten(1).mean(1).sum()


def _batch_similarity(states: torch.Tensor) -> torch.Tensor:
    """[K, B, ..., D] -> [K, N, B, B]: cosine similarity of every pair of images' states per token, centred over the
    batch (as CKA does: a per-feature centring commutes with a rotation, a per-token LayerNorm would not)."""
    if states.shape[1] < 2:
        raise ValueError(f"The 'gram' state norm compares images with each other and needs a batch of at least 2, "
                         f"got {states.shape[1]}: use a larger batch or another state norm.")
    k, b, d = states.shape[0], states.shape[1], states.shape[-1]
    tokens = F.normalize(states - states.mean(dim=1, keepdim=True), dim=-1).reshape(k, b, -1, d).transpose(1, 2)
    return tokens @ tokens.transpose(-1, -2)


def _cls_to_patches(attn: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """CLS query row over the patch keys, renormalised: prefix tokens differ between models (registers), patches
    do not, so the comparable part is how CLS spreads its attention over the image."""
    row = attn[:, :, 0, num_prefix_tokens:]
    return row / row.sum(dim=-1, keepdim=True).clamp_min(1e-12)


def cls_attention_loss(
        student_attn: torch.Tensor,
        teacher_attn: torch.Tensor,
        student_prefix_tokens: int,
        teacher_prefix_tokens: int,
) -> torch.Tensor:
    """L1 between teacher and student CLS-to-patch attention: summed over patches, mean over batch and heads.

    Maps are [B, heads, N, N]; with different head counts each side is averaged over its heads first.
    """
    s = _cls_to_patches(student_attn, student_prefix_tokens)
    t = _cls_to_patches(teacher_attn, teacher_prefix_tokens)
    if s.shape[-1] != t.shape[-1]:
        raise ValueError(f'Student and teacher attend over different patch counts ({s.shape[-1]} vs {t.shape[-1]}).')
    if s.shape[1] != t.shape[1]:
        s, t = s.mean(dim=1, keepdim=True), t.mean(dim=1, keepdim=True)
    return (s - t).abs().sum(dim=-1).mean()


def logit_kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.) -> torch.Tensor:
    """KL(teacher || student) on temperature-softened logits, times T^2 (as timm's LogitDistillationTask)."""
    log_s = F.log_softmax(student_logits / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits / temperature, dim=-1)
    return F.kl_div(log_s, log_t, reduction='batchmean', log_target=True) * temperature ** 2


def jasmin_g(sorted_p: torch.Tensor, k: int) -> torch.Tensor:
    """g_k(p) = p_(k) (1 - p_(k) + p_(k+1)) for rows sorted in decreasing order (k is 1-based)."""
    p_k = sorted_p[..., k - 1]
    p_next = sorted_p[..., k] if k < sorted_p.shape[-1] else torch.zeros_like(p_k)
    return p_k * (1 - p_k + p_next)


def jasmin_loss(attn: torch.Tensor, k: int = 2, detach: bool = False, eps: float = 1e-12) -> torch.Tensor:
    """JaSMin (Yudin et al., arXiv 2507.07814) on attention rows: log(g_1 / g_k), or log g_1 when k == 0.

    Each row's penalty is taken at its worst query (max over rows), then averaged over batch and heads: the
    softmax Jacobian bound is set by the most peaked row. ``detach=True`` computes it on detached maps, as ODE-ViT's
    released code does: the value is logged but no gradient reaches the model.
    """
    if attn.ndim < 2:
        raise ValueError(f'Attention maps need a row axis, got shape {tuple(attn.shape)}.')
    if k < 0 or k == 1 or k > attn.shape[-1]:
        raise ValueError(f'jasmin k must be 0 or in 2..{attn.shape[-1]} (k=1 gives log 1 = 0), got {k}.')
    p = attn.detach() if detach else attn
    # topk keeps the gradient of the selected entries, a full sort is not needed
    top = p.topk(max(k, 1) + 1 if max(k, 1) < p.shape[-1] else p.shape[-1], dim=-1).values
    g1 = jasmin_g(top, 1)
    if k == 0:
        penalty = torch.log(g1 + eps)
    else:
        penalty = torch.log(g1 + eps) - torch.log(jasmin_g(top, k) + eps)
    return penalty.amax(dim=-1).mean()
