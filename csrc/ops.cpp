// kernelwright CUDA C++ ops: the schemas, the Meta (fake) implementations and the Python module.
//
// Every op is declared here with a TORCH_LIBRARY schema so it is a torch.ops.kernelwright.* citizen
// (dispatcher, torch.compile tracing through the Meta kernel, torch.library introspection); its CUDA
// implementation is registered beside the kernel, in csrc/<op>.cu, with TORCH_LIBRARY_IMPL(kernelwright, CUDA).
// This file includes no CUDA header, so it compiles with a plain C++ compiler against any torch build.
//
// Ops
//   fused_adamw_  one AdamW step over lists of same-dtype CUDA tensors, in place (csrc/adamw.cu; the math is
//                 kernels/adamw.py's adamw_step_ref). The step tensors are incremented first, by the op.
//                 masters: an empty list, or one fp32 master copy per parameter (the update runs on it and
//                 params receive its round-to-nearest copy). stochastic_rounding: bf16 params without masters
//                 are rounded stochastically with kernels/adamw.py's counter-based hash.

#include <torch/extension.h>

namespace kernelwright {

// Fake/Meta: the op returns nothing and changes no shape, so tracing only needs the call to exist.
void fused_adamw_meta(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps, double lr,
                      double beta1, double beta2, double eps, double weight_decay, bool maximize,
                      bool stochastic_rounding) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              "fused_adamw_: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length");
  TORCH_CHECK(masters.empty() || masters.size() == n, "fused_adamw_: masters must be empty or one per param");
}

}  // namespace kernelwright

TORCH_LIBRARY(kernelwright, m) {
  m.def(
      "fused_adamw_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, "
      "Tensor(d!)[] masters, Tensor(e!)[] steps, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, bool maximize, bool stochastic_rounding) -> ()");
}

TORCH_LIBRARY_IMPL(kernelwright, Meta, m) { m.impl("fused_adamw_", &kernelwright::fused_adamw_meta); }

// `import kernels._C` loads this library, which runs the registrations above.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kernelwright CUDA ops; call them as torch.ops.kernelwright.<op>";
}
