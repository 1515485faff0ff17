import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_cancel import GRPO, AdditionTask, RLModule, RolloutDataModule
from lit_cancel import float32_products as products
from lit_cancel.float32_products import PRODUCTS, Float32Products, float32_products, wants_float32_products


class ProductDtypes(TorchDispatchMode):
    """Records the dtype of each matrix product that reaches it."""

    def __init__(self):
        super().__init__()
        self.dtypes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in PRODUCTS:
            self.dtypes.append(args[-1].dtype)
        return func(*args, **(kwargs or {}))


def bf16(*shape, generator):
    return torch.randn(*shape, generator=generator).to(torch.bfloat16)


@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm"])
def test_a_product_is_the_exact_product_of_the_bfloat16_values_rounded_once_to_bfloat16(op):
    generator = torch.Generator().manual_seed(0)
    batch = (3,) if op in ("bmm", "baddbmm") else ()
    a, b, c = bf16(*batch, 17, 300, generator=generator), bf16(*batch, 300, 9, generator=generator), bf16(*batch, 17, 9, generator=generator)
    args = {"mm": (a, b), "addmm": (c, a, b), "bmm": (a, b), "baddbmm": (c, a, b)}[op]
    kwargs = {"beta": 0.5, "alpha": 2.0} if op in ("addmm", "baddbmm") else {}
    with Float32Products():
        result = getattr(torch, op)(*args, **kwargs)
    exact = {"mm": lambda: a.double() @ b.double(), "bmm": lambda: a.double() @ b.double(),
             "addmm": lambda: 0.5 * c.double() + 2.0 * (a.double() @ b.double()),
             "baddbmm": lambda: 0.5 * c.double() + 2.0 * (a.double() @ b.double())}[op]()
    assert result.dtype == torch.bfloat16
    # rounding to bfloat16 (8 significant bits) moves a value by at most 2^-8 of itself; float32 sums add far less
    summed_magnitude = a.double().abs() @ b.double().abs()
    assert ((result.double() - exact).abs() <= exact.abs() * 2**-8 + summed_magnitude * 2**-20).all()


def test_under_autocast_forward_and_backward_multiply_in_float32_and_keep_what_autocast_keeps():
    generator = torch.Generator().manual_seed(0)
    layers = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    inputs = torch.randn(5, 16, generator=generator)

    def run(widened: bool):
        layers.zero_grad()
        kept = []
        recorder = ProductDtypes()

        def pack(tensor):
            kept.append((tuple(tensor.shape), tensor.dtype))
            return tensor

        with recorder, float32_products(widened), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = layers(inputs).float().square().sum()
            loss.backward()
        return recorder.dtypes, kept, [p.grad.clone() for p in layers.parameters()]

    native_dtypes, native_kept, native_grads = run(False)
    dtypes, kept, grads = run(True)
    # two forward products, and the backward pass's: both input gradients of the second layer, the first's weight
    assert len(dtypes) == len(native_dtypes) >= 5
    assert set(native_dtypes) == {torch.bfloat16} and set(dtypes) == {torch.float32}
    assert kept == native_kept and torch.bfloat16 in {dtype for _, dtype in kept}
    for grad, native in zip(grads, native_grads, strict=True):
        assert grad.dtype == native.dtype == torch.float32
        torch.testing.assert_close(grad, native, rtol=2e-2, atol=1e-3)


def test_other_dtypes_and_mixed_operands_are_left_alone():
    generator = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 6, generator=generator), torch.randn(6, 3, generator=generator)
    recorder = ProductDtypes()
    with recorder, Float32Products():
        assert torch.equal(a @ b, torch.mm(a, b))
        assert (a.double() @ b.double()).dtype == torch.float64
        torch.addmm(a.sum(1, keepdim=True)[:, :1].expand(4, 3), a.to(torch.bfloat16).float(), b)
    assert set(recorder.dtypes) == {torch.float32, torch.float64}


def test_the_cpu_flags_decide_native_bf16(monkeypatch, tmp_path):
    info = tmp_path / "cpuinfo"
    real_path = products.Path
    monkeypatch.setattr(products, "Path", lambda p: info if p == "/proc/cpuinfo" else real_path(p))
    for flags, native, words in [("fpu sse avx2 avx512f", False, "no bfloat16 instructions"),
                                 ("fpu avx512f avx512_bf16", True, "AVX-512 BF16 without AMX"),
                                 ("fpu avx512_bf16 amx_bf16 amx_tile", True, "AMX")]:
        info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
        assert products.cpu_has_native_bf16() is native
        assert products.bf16_instructions() == words
    info.write_text("processor : 0\n")
    assert products.cpu_has_native_bf16() is None


@pytest.mark.parametrize("native", [False, True, None])
def test_only_a_bf16_precision_on_a_cpu_known_to_lack_bfloat16_instructions_widens(monkeypatch, native):
    monkeypatch.setattr(products, "cpu_has_native_bf16", lambda: native)
    cpu = torch.device("cpu")
    assert wants_float32_products("bf16-mixed", cpu, compiled=False) is (native is False)
    assert wants_float32_products("bf16-true", cpu, compiled=False) is (native is False)
    assert not wants_float32_products("32-true", cpu, compiled=False)
    assert not wants_float32_products("bf16-mixed", cpu, compiled=True)
    assert not wants_float32_products("bf16-mixed", torch.device("cuda"), compiled=False)


@pytest.mark.parametrize("native", [False, True])
def test_an_rl_run_in_bf16_without_bfloat16_instructions_widens_rollouts_training_and_backward(monkeypatch, caplog, native):
    monkeypatch.setattr(products, "cpu_has_native_bf16", lambda: native)
    widened = []  # (in a backward pass, gradients on) of each product computed in float32
    dispatch = Float32Products.__torch_dispatch__

    def recording(self, func, types, args=(), kwargs=None):
        if func in PRODUCTS and all(arg.dtype == torch.bfloat16 for arg in args if isinstance(arg, torch.Tensor)):
            widened.append((torch._C._current_graph_task_id() != -1, torch.is_grad_enabled()))
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(Float32Products, "__torch_dispatch__", recording)
    module = RLModule("embedded:tiny-adder", max_new_tokens=8, objective=GRPO(kl_coef=0.1))
    data = RolloutDataModule(AdditionTask(num_digits=2, train_size=16, val_size=4, seed=0), prompts_per_round=2, group_size=2)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, precision="bf16-mixed", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    with caplog.at_level("INFO"):
        trainer.fit(module, datamodule=data)
        module.setup("validate")  # set up again, as validating before fitting does: said once
    assert module.policy.float32_products is module.reference.float32_products is (not native)
    said = [record.getMessage() for record in caplog.records if "no bfloat16 instructions" in record.getMessage()]
    if native:
        assert widened == [] and said == []
        return
    assert len(said) == 1
    backward, forward_with_grad, without_grad = (sum(1 for phase in widened if phase == kind)
                                                 for kind in [(True, False), (False, True), (False, False)])
    # rollouts, old and reference log-probs without gradients; the training pass; its backward pass
    assert backward > 0 and forward_with_grad > 0 and without_grad > 0
