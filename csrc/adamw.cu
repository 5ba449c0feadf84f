// fused_adamw_: a multi-tensor AdamW step in CUDA C++, the same math as kernels/adamw.py.
//
// Algorithm (per element, fp32 arithmetic; t = the parameter's step after the op's increment)
//     g = maximize ? -grad : grad                               (grad upcast from the param dtype)
//     w = master ? master : float(param)
//     w = w * (1 - lr * weight_decay)                           (decoupled decay first, as torch)
//     m = m + (1 - beta1) * (g - m)                             (torch's lerp for weight < 0.5)
//     v = v * beta2 + (1 - beta2) * g * g
//     w = w + (-step_size * m) / (sqrt(v) / sqrt(1 - beta2^t) + eps),  step_size = lr / (1 - beta1^t)
//     master ? (master = w, param = round_to_nearest(w)) : stochastic ? param = sr_bf16(w) : param = w
// Bias corrections are formed in fp64 from each parameter's own device-side step tensor (no host sync), like
// adamw_step_ref: step_size = float(lr / (1 - beta1^t)), bias_correction2_sqrt = float(sqrt(1 - beta2^t)),
// with lr, beta1, beta2 as the op's double arguments. sqrt and division use the IEEE intrinsics (__fsqrt_rn,
// __fdiv_rn) so that a build with fast-math flags cannot make them approximate; the kernel is bandwidth-bound,
// so exactness costs nothing. What remains against torch is FMA contraction: about one fp32 ulp per step.
// Stochastic rounding (bf16 params, no master) uses the hash of kernels/adamw.py: seed = h(t_u32 ^ h(i + golden))
// with i the tensor's index in the call, noise = h(element ^ seed) & 0xFFFF added below the bf16 mantissa, then
// truncation; NaN passes through. The kernel and the Triton path therefore round identically.
//
// Launch strategy (multi-tensor apply)
//     Every tensor is cut into chunks of kChunk elements; the chunks of all tensors form one index space.
//     A metadata struct, passed by value as the kernel argument, holds per tensor its five data pointers
//     (param, grad, exp_avg, exp_avg_sq, master), its step pointer, numel, first chunk and index in the call.
//     Blocks walk the chunk space grid-stride (grid = min(chunks, 4 * SMs)), find a chunk's tensor by binary
//     search over the first-chunk prefix, and update it with 4 elements per thread per iteration: 16-byte
//     (fp32) / 8-byte (bf16, fp16) vector loads and stores when every pointer of the tensor is 16-byte aligned,
//     scalar loads for the tail and for unaligned tensors.
//     Kernel arguments may be 32 KB with CUDA >= 12.1 on sm_70+, so one launch takes up to 384 tensors (all of a
//     Llama-3.2-1B's 146 or a Qwen2.5-0.5B's 290 in one launch); with older toolkits the 4 KB limit gives 48
//     tensors per launch and a group takes ceil(T / 48) launches. The steps are incremented by one
//     at::_foreach_add_ before the launch(es), as the Triton path does.
//
// Versions tried and measured: version 1 (this file); not yet measured: no GPU in this session. Compile-checked
// only: nvcc 13.0, -std=c++20 -O3 for sm_90 against the CPU torch 2.13 wheel's headers (plus a stand-in for the
// generated c10/cuda/impl/cuda_cmake_macros.h that a CPU wheel lacks); ptxas: 48 (fp32), 51 (bf16/fp16 with
// master), 51 (bf16 stochastic) registers, no spills, so 256-thread blocks are not register-limited. The dispatch in
// kernels/adamw.py therefore keeps Triton under KERNELS_ADAMW_IMPL=auto until a committed GPU measurement
// (bench/bench_adamw.py) shows this op faster. Correctness tests: tests/csrc/test_cuda_ops.py (GPU-marked).

// c10/cuda headers only (not ATen/cuda/CUDAContext.h, which pulls in cuBLAS/cuSPARSE headers this op never uses).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace kernelwright {
namespace {

constexpr int kThreads = 256;
constexpr int kIlp = 4;          // elements per thread per iteration (one vector load per array)
constexpr int64_t kChunk = 8192;  // elements per chunk: 8 iterations of a 256-thread block
constexpr uint32_t kGolden = 0x9E3779B9u;
#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010
constexpr int kMaxTensors = 384;  // 64 B per tensor: ~24.6 KB of the 32 KB kernel-argument limit
#else
constexpr int kMaxTensors = 48;   // ~3 KB of the classic 4 KB limit
#endif

struct AdamWMeta {
  void* param[kMaxTensors];
  const void* grad[kMaxTensors];
  float* exp_avg[kMaxTensors];
  float* exp_avg_sq[kMaxTensors];
  float* master[kMaxTensors];        // nullptr without master weights
  const float* step[kMaxTensors];    // already incremented
  int64_t numel[kMaxTensors];
  int64_t first_chunk[kMaxTensors + 1];  // prefix: tensor t owns chunks [first_chunk[t], first_chunk[t + 1])
  int32_t index[kMaxTensors];        // tensor index in the whole call (seeds stochastic rounding)
  uint8_t aligned[kMaxTensors];      // every pointer of tensor t 16-byte aligned: vector path
  int32_t count;
};

struct Hyper {
  double lr, beta1, beta2;
  float one_minus_beta1, beta2_f, one_minus_beta2, eps, decay;
  bool maximize;
};

__device__ __forceinline__ uint32_t hash32(uint32_t x) {  // lowbias32, as kernels/adamw.py's _hash32
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

template <typename P> __device__ __forceinline__ float to_float(P x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) { return __bfloat162float(x); }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }

template <typename P> __device__ __forceinline__ P from_float(float x);  // round to nearest even
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// kIlp consecutive elements; P is 4 or 2 bytes, so a vector is 16 or 8 bytes.
template <typename T> struct alignas(sizeof(T) * kIlp) Vec { T v[kIlp]; };

template <typename T>
__device__ __forceinline__ void load(const T* base, int64_t i, int64_t n, bool vec, T (&out)[kIlp]) {
  if (vec) {
    const Vec<T> x = *reinterpret_cast<const Vec<T>*>(base + i);
#pragma unroll
    for (int k = 0; k < kIlp; ++k) out[k] = x.v[k];
  } else {
#pragma unroll
    for (int k = 0; k < kIlp; ++k) out[k] = i + k < n ? base[i + k] : from_float<T>(0.0f);
  }
}

template <typename T>
__device__ __forceinline__ void store(T* base, int64_t i, int64_t n, bool vec, const T (&in)[kIlp]) {
  if (vec) {
    Vec<T> x;
#pragma unroll
    for (int k = 0; k < kIlp; ++k) x.v[k] = in[k];
    *reinterpret_cast<Vec<T>*>(base + i) = x;
  } else {
#pragma unroll
    for (int k = 0; k < kIlp; ++k)
      if (i + k < n) base[i + k] = in[k];
  }
}

template <typename P, bool kMaster, bool kStochastic>
__global__ void __launch_bounds__(kThreads) adamw_kernel(const __grid_constant__ AdamWMeta meta, const Hyper h) {
  const int64_t total = meta.first_chunk[meta.count];
  for (int64_t c = blockIdx.x; c < total; c += gridDim.x) {
    int lo = 0, hi = meta.count - 1;  // the last t with first_chunk[t] <= c
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (meta.first_chunk[mid] <= c) lo = mid; else hi = mid - 1;
    }
    const int t = lo;
    const int64_t n = meta.numel[t];
    const int64_t begin = (c - meta.first_chunk[t]) * kChunk;
    const int64_t end = min(begin + kChunk, n);

    // Bias corrections in fp64 from the device-side step (one read per chunk, cached in L1/L2).
    const float s = *meta.step[t];
    const double bc1 = 1.0 - pow(h.beta1, static_cast<double>(s));
    const double bc2 = 1.0 - pow(h.beta2, static_cast<double>(s));
    const float neg_step_size = static_cast<float>(-h.lr / bc1);
    const float bc2_sqrt = static_cast<float>(sqrt(bc2));
    uint32_t seed = 0;
    if (kStochastic) seed = hash32(static_cast<uint32_t>(s) ^ hash32(static_cast<uint32_t>(meta.index[t]) + kGolden));

    P* p_ptr = static_cast<P*>(meta.param[t]);
    const P* g_ptr = static_cast<const P*>(meta.grad[t]);
    float* m_ptr = meta.exp_avg[t];
    float* v_ptr = meta.exp_avg_sq[t];
    float* w_ptr = meta.master[t];
    const bool aligned = meta.aligned[t];

    for (int64_t i = begin + static_cast<int64_t>(threadIdx.x) * kIlp; i < end; i += kThreads * kIlp) {
      const bool vec = aligned && i + kIlp <= end;  // chunks start at multiples of kIlp
      P g_in[kIlp], p_in[kIlp];
      float m[kIlp], v[kIlp], w[kIlp];
      load(g_ptr, i, end, vec, g_in);
      load<float>(m_ptr, i, end, vec, m);
      load<float>(v_ptr, i, end, vec, v);
      if (kMaster) {
        load<float>(w_ptr, i, end, vec, w);
      } else {
        load(static_cast<const P*>(p_ptr), i, end, vec, p_in);
#pragma unroll
        for (int k = 0; k < kIlp; ++k) w[k] = to_float(p_in[k]);
      }
      P p_out[kIlp];
#pragma unroll
      for (int k = 0; k < kIlp; ++k) {
        float g = to_float(g_in[k]);
        if (h.maximize) g = -g;
        w[k] = w[k] * h.decay;
        m[k] = m[k] + h.one_minus_beta1 * (g - m[k]);
        v[k] = v[k] * h.beta2_f + h.one_minus_beta2 * g * g;
        const float denom = __fdiv_rn(__fsqrt_rn(v[k]), bc2_sqrt) + h.eps;
        w[k] = w[k] + __fdiv_rn(neg_step_size * m[k], denom);
        if (kStochastic) {
          const uint32_t noise = hash32(static_cast<uint32_t>(i + k) ^ seed) & 0xFFFFu;
          const uint32_t bits = (__float_as_uint(w[k]) + noise) & 0xFFFF0000u;  // uint: +-inf stay inf
          p_out[k] = from_float<P>(w[k] != w[k] ? w[k] : __uint_as_float(bits));  // exact: low bits are zero
        } else {
          p_out[k] = from_float<P>(w[k]);
        }
      }
      store<float>(m_ptr, i, end, vec, m);
      store<float>(v_ptr, i, end, vec, v);
      if (kMaster) store<float>(w_ptr, i, end, vec, w);
      store(p_ptr, i, end, vec, p_out);
    }
  }
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

template <typename P, bool kMaster, bool kStochastic>
void launch_all(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                at::TensorList masters, at::TensorList steps, const Hyper& h) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, params[0].get_device()));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int64_t n = static_cast<int64_t>(params.size());
  for (int64_t first = 0; first < n;) {
    AdamWMeta meta;
    meta.count = 0;
    meta.first_chunk[0] = 0;
    for (; first < n && meta.count < kMaxTensors; ++first) {
      const int64_t numel = params[first].numel();
      if (numel == 0) continue;
      const int t = meta.count++;
      meta.param[t] = params[first].data_ptr();
      meta.grad[t] = grads[first].data_ptr();
      meta.exp_avg[t] = exp_avgs[first].data_ptr<float>();
      meta.exp_avg_sq[t] = exp_avg_sqs[first].data_ptr<float>();
      meta.master[t] = kMaster ? masters[first].data_ptr<float>() : nullptr;
      meta.step[t] = steps[first].data_ptr<float>();
      meta.numel[t] = numel;
      meta.index[t] = static_cast<int32_t>(first);
      meta.aligned[t] = aligned16(params[first]) && aligned16(grads[first]) && aligned16(exp_avgs[first]) &&
                        aligned16(exp_avg_sqs[first]) && (!kMaster || aligned16(masters[first]));
      meta.first_chunk[t + 1] = meta.first_chunk[t] + (numel + kChunk - 1) / kChunk;
    }
    const int64_t chunks = meta.first_chunk[meta.count];
    if (chunks == 0) continue;
    const int grid = static_cast<int>(std::min<int64_t>(chunks, 4LL * sms));
    adamw_kernel<P, kMaster, kStochastic><<<grid, kThreads, 0, stream>>>(meta, h);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

template <typename P>
void dispatch_mode(bool master, bool stochastic, at::TensorList params, at::TensorList grads, at::TensorList m,
                   at::TensorList v, at::TensorList masters, at::TensorList steps, const Hyper& h) {
  if (master) launch_all<P, true, false>(params, grads, m, v, masters, steps, h);
  else if (stochastic) launch_all<P, false, true>(params, grads, m, v, masters, steps, h);
  else launch_all<P, false, false>(params, grads, m, v, masters, steps, h);
}

void check_inputs(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                  at::TensorList masters, at::TensorList steps, bool stochastic_rounding) {
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
              "fused_adamw_: params, grads, exp_avgs, exp_avg_sqs and steps must have the same length");
  TORCH_CHECK(masters.empty() || masters.size() == n, "fused_adamw_: masters must be empty or one per param");
  if (n == 0) return;
  const auto dtype = params[0].scalar_type();
  const auto device = params[0].device();
  TORCH_CHECK(device.is_cuda(), "fused_adamw_: params must be CUDA tensors");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "fused_adamw_: params must be float32, bfloat16 or float16, got ", dtype);
  const bool master = !masters.empty();
  TORCH_CHECK(!(dtype == at::kFloat && (master || stochastic_rounding)),
              "fused_adamw_: float32 params take neither masters nor stochastic_rounding");
  TORCH_CHECK(dtype == at::kFloat || master || (stochastic_rounding && dtype == at::kBFloat16),
              "fused_adamw_: ", dtype, " params need masters or, for bfloat16, stochastic_rounding=True");
  for (size_t i = 0; i < n; ++i) {
    const auto& p = params[i];
    TORCH_CHECK(p.scalar_type() == dtype && p.device() == device && p.is_contiguous(),
                "fused_adamw_: params[", i, "] must be a contiguous ", dtype, " tensor on ", device);
    TORCH_CHECK(grads[i].scalar_type() == dtype && grads[i].device() == device && grads[i].is_contiguous() &&
                    grads[i].numel() == p.numel(),
                "fused_adamw_: grads[", i, "] must be a contiguous ", dtype, " tensor like params[", i, "]");
    for (const auto* list : {&exp_avgs, &exp_avg_sqs}) {
      const auto& s = (*list)[i];
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.device() == device && s.is_contiguous() && s.numel() == p.numel(),
                  "fused_adamw_: exp_avgs/exp_avg_sqs[", i, "] must be contiguous float32 tensors like params[", i, "]");
    }
    if (master) {
      TORCH_CHECK(masters[i].scalar_type() == at::kFloat && masters[i].device() == device &&
                      masters[i].is_contiguous() && masters[i].numel() == p.numel(),
                  "fused_adamw_: masters[", i, "] must be a contiguous float32 tensor like params[", i, "]");
    }
    TORCH_CHECK(steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1 && steps[i].device() == device,
                "fused_adamw_: steps[", i, "] must be a one-element float32 tensor on ", device);
  }
}

}  // namespace

void fused_adamw_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                      at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps, double lr,
                      double beta1, double beta2, double eps, double weight_decay, bool maximize,
                      bool stochastic_rounding) {
  check_inputs(params, grads, exp_avgs, exp_avg_sqs, masters, steps, stochastic_rounding);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(params[0].device());
  at::_foreach_add_(steps, 1.0);  // t = step + 1, read by the kernel on the same stream
  Hyper h;
  h.lr = lr;
  h.beta1 = beta1;
  h.beta2 = beta2;
  h.one_minus_beta1 = static_cast<float>(1.0 - beta1);
  h.beta2_f = static_cast<float>(beta2);
  h.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.decay = static_cast<float>(1.0 - lr * weight_decay);
  h.maximize = maximize;
  const bool master = !masters.empty();
  const bool stochastic = stochastic_rounding && !master;
  switch (params[0].scalar_type()) {
    case at::kFloat: launch_all<float, false, false>(params, grads, exp_avgs, exp_avg_sqs, masters, steps, h); break;
    case at::kBFloat16:
      dispatch_mode<__nv_bfloat16>(master, stochastic, params, grads, exp_avgs, exp_avg_sqs, masters, steps, h);
      break;
    case at::kHalf: launch_all<__half, true, false>(params, grads, exp_avgs, exp_avg_sqs, masters, steps, h); break;
    default: TORCH_CHECK(false, "fused_adamw_: unsupported dtype");
  }
}

}  // namespace kernelwright

TORCH_LIBRARY_IMPL(kernelwright, CUDA, m) { m.impl("fused_adamw_", &kernelwright::fused_adamw_cuda); }
