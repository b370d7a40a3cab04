// CPU kernels of hp_kernels, registered as `hp_kernels_cpu::*` operators.
//
// The Python package defines the public `hp_kernels::*` ops and picks this library's
// kernels for CPU tensors when it is loaded (torch.ops.load_library); nothing here is called
// directly. There are no Python bindings on purpose: registering through the dispatcher lets
// the library be a plain shared object, and including only <torch/library.h> plus per-operator
// ATen headers (not <torch/extension.h>) keeps the compile short, which matters because every
// environment that installs hp-kernels compiles this file.
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/baddbmm.h>
#include <ATen/ops/clamp.h>
#include <ATen/ops/linalg_vector_norm.h>
#include <ATen/ops/matmul.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace {

// Elements per parallel work item: large enough that scheduling costs nothing next to the
// copy, small enough that a bucket of a few big tensors still spreads over every thread.
constexpr int64_t kChunk = 1 << 15;

// Round-to-nearest-even float -> bf16 on the bit pattern, the rounding ATen's copy_ uses.
// NaN is handled by the caller's select so the loop stays branch-free (and vectorizes).
inline uint16_t f32_to_bf16_bits(uint32_t u) {
  uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>((u + rounding) >> 16);
}

// The conversion loops are compiled for several x86 levels and picked at load time (GCC/Clang
// function multiversioning): the portable build then still uses AVX2/AVX-512 where the CPU has
// them, as ATen's own copy kernels do. Elsewhere they are plain loops.
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(HP_KERNELS_NO_CLONES)
#define HP_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define HP_CLONES
#endif

HP_CLONES void f32_to_bf16(const float* src, c10::BFloat16* dst, int64_t n) {
  auto* out = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, src + i, sizeof(u));
    const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
    out[i] = nan ? static_cast<uint16_t>(0x7fc0u) : f32_to_bf16_bits(u);
  }
}

HP_CLONES void bf16_to_f32(const c10::BFloat16* src, float* dst, int64_t n) {
  const auto* in = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(in[i]) << 16;
    std::memcpy(dst + i, &u, sizeof(u));
  }
}

// Every other pair goes through c10's scalar conversions (the ones ATen's copy_ is defined by).
template <typename S, typename D>
void convert(const S* src, D* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    dst[i] = static_cast<D>(static_cast<float>(src[i]));
  }
}

template <>
void convert<float, c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  f32_to_bf16(src, dst, n);
}

template <>
void convert<c10::BFloat16, float>(const c10::BFloat16* src, float* dst, int64_t n) {
  bf16_to_f32(src, dst, n);
}

bool convertible(at::ScalarType t) {
  return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
}

// One contiguous piece of one tensor, copied (and cast) by one thread.
struct Piece {
  const char* src;
  char* dst;
  int64_t n;
  at::ScalarType from;
  at::ScalarType to;
};

template <typename S>
void convert_from(const Piece& p) {
  const auto* src = reinterpret_cast<const S*>(p.src);
  switch (p.to) {
    case at::kFloat:
      convert<S, float>(src, reinterpret_cast<float*>(p.dst), p.n);
      break;
    case at::kBFloat16:
      convert<S, c10::BFloat16>(src, reinterpret_cast<c10::BFloat16*>(p.dst), p.n);
      break;
    case at::kHalf:
      convert<S, c10::Half>(src, reinterpret_cast<c10::Half*>(p.dst), p.n);
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "unreachable: checked by convertible()");
  }
}

void run_piece(const Piece& p) {
  if (p.from == p.to) {
    std::memcpy(p.dst, p.src, static_cast<size_t>(p.n) * c10::elementSize(p.from));
    return;
  }
  switch (p.from) {
    case at::kFloat:
      convert_from<float>(p);
      break;
    case at::kBFloat16:
      convert_from<c10::BFloat16>(p);
      break;
    case at::kHalf:
      convert_from<c10::Half>(p);
      break;
    default:
      TORCH_INTERNAL_ASSERT(false, "unreachable: checked by convertible()");
  }
}

// Cut `n` elements at (src, dst) into pieces; the pieces of every tensor of a bucket go into
// one list so that one parallel region covers the whole bucket.
void add_pieces(std::vector<Piece>& pieces, const at::Tensor& src, const at::Tensor& dst) {
  const int64_t n = src.numel();
  const auto from = src.scalar_type();
  const auto to = dst.scalar_type();
  const auto* s = static_cast<const char*>(src.const_data_ptr());
  auto* d = static_cast<char*>(dst.mutable_data_ptr());
  const auto ss = static_cast<int64_t>(c10::elementSize(from));
  const auto ds = static_cast<int64_t>(c10::elementSize(to));
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t len = std::min(kChunk, n - start);
    pieces.push_back(Piece{s + start * ss, d + start * ds, len, from, to});
  }
}

// Copies src[i] into dst[i] for every pair; the Python side has checked counts, sizes and
// devices. Pairs this kernel cannot take (a non-contiguous side, a dtype pair other than
// fp32/bf16/fp16 casts or same-dtype copies) go through ATen's copy_, which defines the result.
void copy_pairs(const std::vector<at::Tensor>& srcs, const std::vector<at::Tensor>& dsts) {
  std::vector<Piece> pieces;
  std::vector<size_t> fallback;
  for (size_t i = 0; i < srcs.size(); ++i) {
    const auto& s = srcs[i];
    const auto& d = dsts[i];
    if (s.numel() == 0) {
      continue;
    }
    const bool same = s.scalar_type() == d.scalar_type();
    const bool castable = convertible(s.scalar_type()) && convertible(d.scalar_type());
    if (s.is_contiguous() && d.is_contiguous() && (same || castable)) {
      add_pieces(pieces, s, d);
    } else {
      fallback.push_back(i);
    }
  }
  const auto count = static_cast<int64_t>(pieces.size());
  at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      run_piece(pieces[static_cast<size_t>(i)]);
    }
  });
  for (size_t i : fallback) {
    dsts[i].copy_(srcs[i]);
  }
}

void pack(at::TensorList tensors, const at::Tensor& out, c10::IntArrayRef offsets) {
  std::vector<at::Tensor> srcs(tensors.begin(), tensors.end());
  std::vector<at::Tensor> dsts;
  dsts.reserve(srcs.size());
  for (size_t i = 0; i < srcs.size(); ++i) {
    dsts.push_back(out.narrow(0, offsets[i], srcs[i].numel()).view(srcs[i].sizes()));
  }
  copy_pairs(srcs, dsts);
}

void unpack(const at::Tensor& flat, c10::IntArrayRef offsets, at::TensorList outs) {
  std::vector<at::Tensor> dsts(outs.begin(), outs.end());
  std::vector<at::Tensor> srcs;
  srcs.reserve(dsts.size());
  for (size_t i = 0; i < dsts.size(); ++i) {
    srcs.push_back(flat.narrow(0, offsets[i], dsts[i].numel()).view(dsts[i].sizes()));
  }
  copy_pairs(srcs, dsts);
}

// The exact ATen op sequence of hp_kernels.reference.newton_schulz (and so of
// torch.optim.Muon for one matrix): results are bit-equal to it on the same machine. What this
// saves is the Python interpreter between the ops, not arithmetic.
at::Tensor newton_schulz(
    const at::Tensor& input,
    c10::ArrayRef<double> a,
    c10::ArrayRef<double> b,
    c10::ArrayRef<double> c,
    double eps) {
  at::Tensor x = input.to(at::kBFloat16);
  const int64_t d = x.dim();
  const bool tall = x.size(d - 2) > x.size(d - 1);
  if (tall) {
    x = x.mT();
  }
  at::Tensor norm = d == 2
      ? at::linalg_vector_norm(x, 2, std::nullopt, false, std::nullopt)
      : at::linalg_vector_norm(x, 2, at::IntArrayRef({-2, -1}), true, std::nullopt);
  x = x.div(at::clamp(norm, eps, std::nullopt));
  for (size_t i = 0; i < a.size(); ++i) {
    at::Tensor gram = at::matmul(x, x.mT());
    if (d == 2) {
      at::Tensor update = at::addmm(gram, gram, gram, b[i], c[i]);
      x = at::addmm(x, update, x, a[i]);
    } else {
      at::Tensor update = at::baddbmm(gram, gram, gram, b[i], c[i]);
      x = at::baddbmm(x, update, x, a[i]);
    }
  }
  return tall ? x.mT() : x;
}

}  // namespace

TORCH_LIBRARY(hp_kernels_cpu, m) {
  m.def("pack(Tensor[] tensors, Tensor(a!) out, int[] offsets) -> ()");
  m.def("unpack(Tensor flat, int[] offsets, Tensor(a!)[] outs) -> ()");
  m.def("newton_schulz(Tensor x, float[] a, float[] b, float[] c, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(hp_kernels_cpu, CPU, m) {
  m.impl("pack", &pack);
  m.impl("unpack", &unpack);
  m.impl("newton_schulz", &newton_schulz);
}
