// DIFF V1 Eq.1 on the CPU: (softmax(Q1 K1^T) - lambda softmax(Q2 K2^T)) V, forward and backward,
// fp32, one row tile of query rows per task. The algorithm, its cost and the masking rule are
// documented in diffattn/attention/cpu_kernel.py; this file is its implementation.
//
// Layout (all contiguous fp32, made so by the Python caller):
//   q1, q2  (B, Hkv, N*rep, d)   query rows of one KV group, position-major (unscaled)
//   k1, k2  (B, Hkv, S, d)
//   v       (B, Hkv, S, dv)
//   out     (B, Hkv, N*rep, dv); lse1, lse2 (B, Hkv, N*rep): each map's log-sum-exp
//   key_padding (B, S) uint8 (1 = real token) or an undefined tensor
//   documents (B, S) int64 document of each key position (packed rows) or an undefined tensor
// Query position i (row i*rep + r) may read key j iff j <= i + offset and (key j is real or
// j == i + offset), and key j lies in the query's document (documents[i + offset]): the rule
// of diffattn.attention.mask.AttentionMask.

// Only the headers of what is used (not ATen/ATen.h): the build takes about a third less time
// (a first use compiles this file) and the object code is the same.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n,
                       const int* k, const float* alpha, const float* a, const int* lda,
                       const float* b, const int* ldb, const float* beta, float* c,
                       const int* ldc);

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Row-major C[M x N] = alpha * op(A)[M x K] * op(B)[K x N] + beta * C, through the BLAS that
// PyTorch links (column-major: C^T = op(B)^T op(A)^T).
void gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float* a, int lda,
          const float* b, int ldb, float beta, float* c, int ldc) {
  if (m == 0 || n == 0) return;
  const char ta = trans_b ? 'T' : 'N';
  const char tb = trans_a ? 'T' : 'N';
  sgemm_(&ta, &tb, &n, &m, &k, &alpha, b, &ldb, a, &lda, &beta, c, &ldc);
}

// Adds the lanes of `acc` to `total` and clears `acc` (long rows are summed in double).
void flush(Vec& acc, double& total) {
  float lanes[Vec::size()];
  acc.store(lanes);
  for (int l = 0; l < Vec::size(); ++l) total += lanes[l];
  acc = Vec(0.f);
}

float row_max(const float* x, int n) {
  constexpr int W = Vec::size();
  float best = kNegInf;
  int j = 0;
  if (n >= W) {
    Vec acc = Vec::loadu(x);
    for (j = W; j + W <= n; j += W) acc = at::vec::maximum(acc, Vec::loadu(x + j));
    float lanes[W];
    acc.store(lanes);
    for (int l = 0; l < W; ++l) best = std::max(best, lanes[l]);
  }
  for (; j < n; ++j) best = std::max(best, x[j]);
  return best;
}

// x[j] = exp(x[j] - shift) for j < n; returns the sum (in double: a row may hold 10^5 terms).
double exp_inplace(float* x, int n, float shift) {
  constexpr int W = Vec::size();
  const Vec s(shift);
  Vec acc(0.f);
  int j = 0;
  double total = 0.0;
  for (; j + W <= n; j += W) {
    Vec e = (Vec::loadu(x + j) - s).exp();
    e.store(x + j);
    acc = acc + e;
    if (((j / W) & 63) == 63) flush(acc, total);  // every 64 vectors
  }
  flush(acc, total);
  for (; j < n; ++j) {
    x[j] = std::exp(x[j] - shift);
    total += x[j];
  }
  return total;
}

double row_dot(const float* a, const float* b, int n) {
  constexpr int W = Vec::size();
  Vec acc(0.f);
  int j = 0;
  double total = 0.0;
  for (; j + W <= n; j += W) {
    acc = at::vec::fmadd(Vec::loadu(a + j), Vec::loadu(b + j), acc);
    if (((j / W) & 63) == 63) flush(acc, total);
  }
  flush(acc, total);
  for (; j < n; ++j) total += static_cast<double>(a[j]) * b[j];
  return total;
}

float dot(const float* a, const float* b, int n) {
  constexpr int W = Vec::size();
  Vec acc(0.f);
  int j = 0;
  for (; j + W <= n; j += W) acc = at::vec::fmadd(Vec::loadu(a + j), Vec::loadu(b + j), acc);
  float lanes[W];
  acc.store(lanes);
  float total = 0.f;
  for (int l = 0; l < W; ++l) total += lanes[l];
  for (; j < n; ++j) total += a[j] * b[j];
  return total;
}

// y += alpha * x
void axpy(float* y, float alpha, const float* x, int n) {
  constexpr int W = Vec::size();
  const Vec a(alpha);
  int j = 0;
  for (; j + W <= n; j += W) at::vec::fmadd(a, Vec::loadu(x + j), Vec::loadu(y + j)).store(y + j);
  for (; j < n; ++j) y[j] += alpha * x[j];
}

// Tiles of at most this many rows (decode steps: one query position, a GQA group's heads)
// skip BLAS, whose packing of K and V would read them twice: keys and values stream once.
constexpr int kStreamRows = 8;

struct Task {
  int64_t bg;         // batch * Hkv + kv head
  int64_t pos_start;  // first query position of the tile
  int64_t pos_stop;   // one past its last
  int64_t keys;       // keys the tile reads: [0, keys)
};

struct Problem {
  int64_t bsz, n_kv, n, rep, d, dv, s, offset, tile_positions;
  int64_t k1_sb, k1_sh, k2_sb, k2_sh, v_sb, v_sh;  // batch and head strides of the inputs
  const uint8_t* padding;  // (B, S) or nullptr
  const int64_t* documents;  // (B, S) document of each key position, or nullptr
  int64_t rows() const { return n * rep; }
  // Offsets of one (batch, KV head) in k1, k2, v (strided: views of a cache are taken as
  // they are) and in the contiguous gradient buffers.
  int64_t k1_at(int64_t bg) const { return (bg / n_kv) * k1_sb + (bg % n_kv) * k1_sh; }
  int64_t k2_at(int64_t bg) const { return (bg / n_kv) * k2_sb + (bg % n_kv) * k2_sh; }
  int64_t v_at(int64_t bg) const { return (bg / n_kv) * v_sb + (bg % n_kv) * v_sh; }
  int64_t last_key(int64_t pos) const { return pos + offset; }  // the diagonal key
  // The key padding and documents of the batch row of (batch, KV head) bg, or nullptr.
  const uint8_t* padding_of(int64_t bg) const {
    return padding ? padding + (bg / n_kv) * s : nullptr;
  }
  const int64_t* documents_of(int64_t bg) const {
    return documents ? documents + (bg / n_kv) * s : nullptr;
  }
};

// The extent of one task: its first row in the (batch, KV head), its rows m and keys e, the
// widths d and dv, and the offset of its first query row in q1 and q2.
struct TaskShape {
  int64_t row0;
  int m, e, d, dv;
  int64_t qo;
};

TaskShape shape_of(const Problem& p, const Task& t) {
  const int64_t row0 = t.pos_start * p.rep;
  return {row0,
          static_cast<int>((t.pos_stop - t.pos_start) * p.rep),
          static_cast<int>(t.keys),
          static_cast<int>(p.d),
          static_cast<int>(p.dv),
          t.bg * p.rows() * p.d + row0 * p.d};
}

// The data of a (B, S) tensor with one entry per key position, checked against the problem's
// shape (`what` states the required type in the message); nullptr when it is undefined.
template <typename T>
const T* key_rows(const at::Tensor& t, at::ScalarType type, const Problem& p, const char* what) {
  if (!t.defined()) return nullptr;
  TORCH_CHECK(t.scalar_type() == type && t.dim() == 2 && t.size(0) == p.bsz && t.size(1) == p.s,
              "diff_v1_cpu: ", what, " of shape (B, S) = (", p.bsz, ", ", p.s, "), got ",
              t.sizes());
  return t.data_ptr<T>();
}

Problem make_problem(const at::Tensor& q1, const at::Tensor& k1, const at::Tensor& k2,
                     const at::Tensor& v, int64_t rep, int64_t offset,
                     const at::Tensor& padding, const at::Tensor& documents,
                     int64_t tile_positions) {
  TORCH_CHECK(q1.dim() == 4 && k1.dim() == 4 && v.dim() == 4, "diff_v1_cpu: 4-d tensors expected");
  Problem p{};
  p.bsz = k1.size(0);
  p.n_kv = k1.size(1);
  p.s = k1.size(2);
  p.d = k1.size(3);
  p.dv = v.size(3);
  p.rep = rep;
  TORCH_CHECK(q1.size(2) % rep == 0, "diff_v1_cpu: rows not a multiple of the group size");
  p.n = q1.size(2) / rep;
  p.offset = offset;
  TORCH_CHECK(offset >= 0 && p.n + offset <= p.s, "diff_v1_cpu: query offset out of range");
  p.tile_positions = std::max<int64_t>(1, tile_positions);
  p.k1_sb = k1.stride(0);
  p.k1_sh = k1.stride(1);
  p.k2_sb = k2.stride(0);
  p.k2_sh = k2.stride(1);
  p.v_sb = v.stride(0);
  p.v_sh = v.stride(1);
  p.padding = key_rows<uint8_t>(padding, at::kByte, p, "key padding must be uint8");
  p.documents = key_rows<int64_t>(documents, at::kLong, p, "documents must be int64");
  return p;
}

// Tasks of the call, split into `slots` lists of near-equal work (rows x keys), longest first
// to the least-loaded list: deterministic for a given slot count.
std::vector<std::vector<Task>> schedule(const Problem& p, int64_t slots) {
  std::vector<Task> tasks;
  for (int64_t bg = 0; bg < p.bsz * p.n_kv; ++bg) {
    for (int64_t start = 0; start < p.n; start += p.tile_positions) {
      const int64_t stop = std::min(p.n, start + p.tile_positions);
      tasks.push_back({bg, start, stop, std::min(p.s, stop + p.offset)});
    }
  }
  std::vector<int64_t> order(tasks.size());
  std::iota(order.begin(), order.end(), 0);
  auto cost = [&](int64_t i) { return (tasks[i].pos_stop - tasks[i].pos_start) * tasks[i].keys; };
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost(a) > cost(b); });
  slots = std::max<int64_t>(1, std::min<int64_t>(slots, tasks.size()));
  std::vector<std::vector<Task>> parts(slots);
  std::vector<int64_t> load(slots, 0);
  for (int64_t i : order) {
    const int64_t slot = std::min_element(load.begin(), load.end()) - load.begin();
    parts[slot].push_back(tasks[i]);
    load[slot] += cost(i);
  }
  for (auto& part : parts) {
    std::sort(part.begin(), part.end(), [](const Task& a, const Task& b) {
      return a.bg != b.bg ? a.bg < b.bg : a.pos_start < b.pos_start;
    });
  }
  return parts;
}

// Mask key padding of one score row in place: keys j < diag that are padding get -inf, and a
// padding query (real[diag] == 0) reads only its own position.
void mask_padding(float* row, const uint8_t* real, int64_t diag) {
  const bool real_query = real[diag] != 0;
  for (int64_t j = 0; j < diag; ++j) {
    if (!real_query || !real[j]) row[j] = kNegInf;
  }
}

// Mask the keys of other documents in one score row in place: keys j < diag whose document
// differs from the query's (the document of key position diag) get -inf.
void mask_documents(float* row, const int64_t* doc, int64_t diag) {
  const int64_t own = doc[diag];
  for (int64_t j = 0; j < diag; ++j) {
    if (doc[j] != own) row[j] = kNegInf;
  }
}

void forward_task(const Problem& p, const Task& t, const float* q1, const float* q2,
                  const float* k1, const float* k2, const float* v, float lam, float scale,
                  float* out,
                  float* lse1, float* lse2, float* buf1, float* buf2) {
  const auto [row0, m, e, d, dv, qo] = shape_of(p, t);
  const float* k1b = k1 + p.k1_at(t.bg);
  const float* k2b = k2 + p.k2_at(t.bg);
  const bool stream = m <= kStreamRows;
  if (stream) {
    for (int j = 0; j < e; ++j) {
      const float* k1j = k1b + static_cast<int64_t>(j) * d;
      const float* k2j = k2b + static_cast<int64_t>(j) * d;
      for (int r = 0; r < m; ++r) {
        const int64_t qr = qo + static_cast<int64_t>(r) * d;
        buf1[static_cast<int64_t>(r) * e + j] = scale * dot(q1 + qr, k1j, d);
        buf2[static_cast<int64_t>(r) * e + j] = scale * dot(q2 + qr, k2j, d);
      }
    }
  } else {
    gemm(false, true, m, e, d, scale, q1 + qo, d, k1b, d, 0.f, buf1, e);
    gemm(false, true, m, e, d, scale, q2 + qo, d, k2b, d, 0.f, buf2, e);
  }
  const uint8_t* real = p.padding_of(t.bg);
  const int64_t* docs = p.documents_of(t.bg);
  for (int r = 0; r < m; ++r) {
    const int64_t diag = p.last_key(t.pos_start + r / p.rep);
    const int len = static_cast<int>(diag + 1);
    float* s1 = buf1 + static_cast<int64_t>(r) * e;
    float* s2 = buf2 + static_cast<int64_t>(r) * e;
    if (real) {
      mask_padding(s1, real, diag);
      mask_padding(s2, real, diag);
    }
    if (docs) {
      mask_documents(s1, docs, diag);
      mask_documents(s2, docs, diag);
    }
    const float max1 = row_max(s1, len), max2 = row_max(s2, len);
    const double sum1 = exp_inplace(s1, len, max1), sum2 = exp_inplace(s2, len, max2);
    const Vec inv1(static_cast<float>(1.0 / sum1)), coef2(static_cast<float>(lam / sum2));
    constexpr int W = Vec::size();
    int j = 0;
    for (; j + W <= len; j += W) {
      (Vec::loadu(s1 + j) * inv1 - Vec::loadu(s2 + j) * coef2).store(s1 + j);
    }
    for (; j < len; ++j) {
      s1[j] = s1[j] * static_cast<float>(1.0 / sum1) - s2[j] * static_cast<float>(lam / sum2);
    }
    std::fill(s1 + len, s1 + e, 0.f);
    lse1[t.bg * p.rows() + row0 + r] = max1 + static_cast<float>(std::log(sum1));
    lse2[t.bg * p.rows() + row0 + r] = max2 + static_cast<float>(std::log(sum2));
  }
  float* o = out + t.bg * p.rows() * p.dv + row0 * p.dv;
  const float* vb = v + p.v_at(t.bg);
  if (!stream) {
    gemm(false, false, m, dv, e, 1.f, buf1, e, vb, dv, 0.f, o, dv);
    return;
  }
  std::fill(o, o + static_cast<int64_t>(m) * dv, 0.f);
  for (int j = 0; j < e; ++j) {
    const float* vj = vb + static_cast<int64_t>(j) * dv;
    for (int r = 0; r < m; ++r) {
      const float pj = buf1[static_cast<int64_t>(r) * e + j];
      if (pj != 0.f) axpy(o + static_cast<int64_t>(r) * dv, pj, vj, dv);
    }
  }
}

// P_a = exp(S_a - lse_a) on one row's allowed keys, zero beyond.
void probs_row(float* s, int len, int e, float lse, const uint8_t* real, const int64_t* docs,
               int64_t diag) {
  if (real) mask_padding(s, real, diag);
  if (docs) mask_documents(s, docs, diag);
  exp_inplace(s, len, lse);
  std::fill(s + len, s + e, 0.f);
}

void backward_task(const Problem& p, const Task& t, const float* q1, const float* q2,
                   const float* k1, const float* k2, const float* v, const float* grad,
                   const float* lse1, const float* lse2, float lam, float scale, float* dq1,
                   float* dq2, float* dk1, float* dk2, float* dv_acc, double* dlam,
                   float* buf1, float* buf2, float* buf3, float* buf4) {
  const auto [row0, m, e, d, dv, qo] = shape_of(p, t);
  const int64_t go = t.bg * p.rows() * p.dv + row0 * p.dv;
  const int64_t ko = t.bg * p.s * p.d, vo = t.bg * p.s * p.dv;  // in the gradient buffers
  const float* k1b = k1 + p.k1_at(t.bg);
  const float* k2b = k2 + p.k2_at(t.bg);
  gemm(false, true, m, e, d, scale, q1 + qo, d, k1b, d, 0.f, buf1, e);
  gemm(false, true, m, e, d, scale, q2 + qo, d, k2b, d, 0.f, buf2, e);
  gemm(false, true, m, e, dv, 1.f, grad + go, dv, v + p.v_at(t.bg), dv, 0.f, buf3, e);  // dP
  const uint8_t* real = p.padding_of(t.bg);
  const int64_t* docs = p.documents_of(t.bg);
  constexpr int W = Vec::size();
  const Vec vlam(lam);
  double r2_total = 0.0;
  for (int r = 0; r < m; ++r) {
    const int64_t diag = p.last_key(t.pos_start + r / p.rep);
    const int len = static_cast<int>(diag + 1);
    const int64_t row = t.bg * p.rows() + row0 + r;
    float* p1 = buf1 + static_cast<int64_t>(r) * e;
    float* p2 = buf2 + static_cast<int64_t>(r) * e;
    const float* dp = buf3 + static_cast<int64_t>(r) * e;
    float* pc = buf4 + static_cast<int64_t>(r) * e;
    probs_row(p1, len, e, lse1[row], real, docs, diag);
    probs_row(p2, len, e, lse2[row], real, docs, diag);
    const float r1s = static_cast<float>(row_dot(dp, p1, len));
    const double r2d = row_dot(dp, p2, len);
    const float r2s = static_cast<float>(r2d);
    const Vec r1(r1s), r2(r2s);
    r2_total += r2d;
    int j = 0;
    for (; j + W <= len; j += W) {
      const Vec a = Vec::loadu(p1 + j), b = Vec::loadu(p2 + j), g = Vec::loadu(dp + j);
      (a - vlam * b).store(pc + j);
      (a * (g - r1)).store(p1 + j);  // dS1
      (b * (g - r2)).store(p2 + j);  // dS2 / (-lambda)
    }
    for (; j < len; ++j) {
      const float a = p1[j], b = p2[j], g = dp[j];
      pc[j] = a - lam * b;
      p1[j] = a * (g - r1s);
      p2[j] = b * (g - r2s);
    }
    std::fill(pc + len, pc + e, 0.f);
  }
  *dlam -= r2_total;
  gemm(true, false, e, dv, m, 1.f, buf4, e, grad + go, dv, 1.f, dv_acc + vo, dv);  // dV += P^T G
  gemm(false, false, m, d, e, scale, buf1, e, k1b, d, 0.f, dq1 + qo, d);
  gemm(false, false, m, d, e, -lam * scale, buf2, e, k2b, d, 0.f, dq2 + qo, d);
  gemm(true, false, e, d, m, scale, buf1, e, q1 + qo, d, 1.f, dk1 + ko, d);
  gemm(true, false, e, d, m, -lam * scale, buf2, e, q2 + qo, d, 1.f, dk2 + ko, d);
}

void check_inputs(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "diff_v1_cpu: contiguous fp32 CPU tensors expected");
  }
}

// Keys and values may be views (a cache's interleaved maps): any batch and head strides,
// rows of contiguous features back to back (a single row's stride is never read).
void check_keys(std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4 &&
                    t->stride(3) == 1 && (t->size(2) == 1 || t->stride(2) == t->size(3)),
                "diff_v1_cpu: fp32 CPU keys/values with contiguous rows expected");
  }
}

int64_t slot_count() { return std::max<int64_t>(1, at::get_num_threads()); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> diff_v1_forward(
    const at::Tensor& q1, const at::Tensor& q2, const at::Tensor& k1, const at::Tensor& k2,
    const at::Tensor& v, double lam, double scale, int64_t rep, int64_t offset,
    const std::optional<at::Tensor>& key_padding, const std::optional<at::Tensor>& documents,
    int64_t tile_positions) {
  check_inputs({&q1, &q2});
  check_keys({&k1, &k2, &v});
  const at::Tensor padding = key_padding.has_value() ? key_padding->contiguous() : at::Tensor();
  const at::Tensor docs = documents.has_value() ? documents->contiguous() : at::Tensor();
  const Problem p = make_problem(q1, k1, k2, v, rep, offset, padding, docs, tile_positions);
  at::Tensor out = at::empty({p.bsz, p.n_kv, p.rows(), p.dv}, q1.options());
  at::Tensor lse1 = at::empty({p.bsz, p.n_kv, p.rows()}, q1.options());
  at::Tensor lse2 = at::empty_like(lse1);
  const auto parts = schedule(p, slot_count());
  const int64_t tile_rows = p.tile_positions * p.rep;
  at::parallel_for(0, static_cast<int64_t>(parts.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf1(tile_rows * p.s), buf2(tile_rows * p.s);
    for (int64_t slot = begin; slot < end; ++slot) {
      for (const Task& t : parts[slot]) {
        forward_task(p, t, q1.data_ptr<float>(), q2.data_ptr<float>(), k1.data_ptr<float>(),
                     k2.data_ptr<float>(), v.data_ptr<float>(), static_cast<float>(lam),
                     static_cast<float>(scale), out.data_ptr<float>(), lse1.data_ptr<float>(), lse2.data_ptr<float>(),
                     buf1.data(), buf2.data());
      }
    }
  });
  return {out, lse1, lse2};
}

std::vector<at::Tensor> diff_v1_backward(
    const at::Tensor& grad, const at::Tensor& q1, const at::Tensor& q2, const at::Tensor& k1,
    const at::Tensor& k2, const at::Tensor& v, const at::Tensor& lse1, const at::Tensor& lse2,
    double lam, double scale, int64_t rep, int64_t offset,
    const std::optional<at::Tensor>& key_padding, const std::optional<at::Tensor>& documents,
    int64_t tile_positions) {
  check_inputs({&grad, &q1, &q2, &lse1, &lse2});
  check_keys({&k1, &k2, &v});
  const at::Tensor padding = key_padding.has_value() ? key_padding->contiguous() : at::Tensor();
  const at::Tensor docs = documents.has_value() ? documents->contiguous() : at::Tensor();
  const Problem p = make_problem(q1, k1, k2, v, rep, offset, padding, docs, tile_positions);
  const auto parts = schedule(p, slot_count());
  const int64_t slots = static_cast<int64_t>(parts.size());
  at::Tensor dq1 = at::empty_like(q1), dq2 = at::empty_like(q2);
  // Per-slot accumulators for the key-side gradients (tiles of one KV head run on any slot).
  at::Tensor dk1 = at::zeros({slots, p.bsz, p.n_kv, p.s, p.d}, k1.options());
  at::Tensor dk2 = at::zeros_like(dk1);
  at::Tensor dv = at::zeros({slots, p.bsz, p.n_kv, p.s, p.dv}, v.options());
  std::vector<double> dlam(slots, 0.0);
  const int64_t tile_rows = p.tile_positions * p.rep;
  at::parallel_for(0, slots, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf1(tile_rows * p.s), buf2(tile_rows * p.s), buf3(tile_rows * p.s),
        buf4(tile_rows * p.s);
    for (int64_t slot = begin; slot < end; ++slot) {
      const int64_t k_off = slot * p.bsz * p.n_kv * p.s * p.d;
      const int64_t v_off = slot * p.bsz * p.n_kv * p.s * p.dv;
      for (const Task& t : parts[slot]) {
        backward_task(p, t, q1.data_ptr<float>(), q2.data_ptr<float>(), k1.data_ptr<float>(),
                      k2.data_ptr<float>(), v.data_ptr<float>(), grad.data_ptr<float>(),
                      lse1.data_ptr<float>(), lse2.data_ptr<float>(), static_cast<float>(lam),
                      static_cast<float>(scale), dq1.data_ptr<float>(), dq2.data_ptr<float>(),
                      dk1.data_ptr<float>() + k_off, dk2.data_ptr<float>() + k_off,
                      dv.data_ptr<float>() + v_off, &dlam[slot], buf1.data(), buf2.data(),
                      buf3.data(), buf4.data());
      }
    }
  });
  const double dlam_total = std::accumulate(dlam.begin(), dlam.end(), 0.0);
  return {dq1, dq2, dk1.sum(0), dk2.sum(0), dv.sum(0),
          at::scalar_tensor(dlam_total, q1.options().dtype(at::kDouble))};
}

}  // namespace

TORCH_LIBRARY(diffattn_cpu, m) {
  m.def(
      "diff_v1_forward(Tensor q1, Tensor q2, Tensor k1, Tensor k2, Tensor v, float lam, "
      "float scale, int rep, int offset, Tensor? key_padding, Tensor? documents, "
      "int tile_positions) -> "
      "(Tensor, Tensor, Tensor)");
  m.def(
      "diff_v1_backward(Tensor grad, Tensor q1, Tensor q2, Tensor k1, Tensor k2, Tensor v, "
      "Tensor lse1, Tensor lse2, float lam, float scale, int rep, int offset, "
      "Tensor? key_padding, Tensor? documents, int tile_positions) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(diffattn_cpu, CPU, m) {
  m.impl("diff_v1_forward", &diff_v1_forward);
  m.impl("diff_v1_backward", &diff_v1_backward);
}
