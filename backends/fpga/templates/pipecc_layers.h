// pipecc layer library for Vitis HLS (Apache-2.0). Each layer is one DATAFLOW process that
// reads an hls::stream, writes an hls::stream and takes its sizes from a config struct C
// (parameters.h). Tensors stream in torch's NCHW order (no channels-last anywhere), so
// flatten/view cost nothing. MAC layers buffer one input frame and fold like FINN's MVAU:
// PE output channels x SIMD inputs per cycle, reuse_factor = (MH/PE)*(MW/SIMD).
// NOTE: conv2d reads its window from a whole-frame buffer; a line buffer is the next step for
// large images (the analytic model in pipecc/fpga_model.py charges this design's cycles).
#ifndef PIPECC_LAYERS_H
#define PIPECC_LAYERS_H

#include <cmath>
#include "hls_stream.h"

#if !defined(__SYNTHESIS__) && defined(PIPECC_CSIM_STREAM)
// pipecc's g++ C simulation: each process of the DATAFLOW region is a task that runs
// sequentially or in its own thread (see csim_include/hls_stream.h).
#define PIPECC_DATAFLOW_BEGIN hls::csim::Dataflow pipecc_dataflow_;
#define PIPECC_PROCESS(label, ...) pipecc_dataflow_.add(#label, [&]() { __VA_ARGS__; });
#define PIPECC_DATAFLOW_END pipecc_dataflow_.run();
#define PIPECC_SET_DEPTH(s, d) s.set_depth(d);
#else
#define PIPECC_DATAFLOW_BEGIN
#define PIPECC_PROCESS(label, ...) __VA_ARGS__;
#define PIPECC_DATAFLOW_END
#define PIPECC_SET_DEPTH(s, d)
#endif

#ifdef __SYNTHESIS__
#include "hls_math.h"
#define PIPECC_ERF hls::erf
#define PIPECC_TANH hls::tanh
#else
#include <cstdio>
#include <string>
#include <vector>
#define PIPECC_ERF std::erf
#define PIPECC_TANH std::tanh
#endif

namespace pipecc {

template <class T, unsigned N>
void read_frame(hls::stream<T>& in, T buf[N]) {
ReadFrame:
  for (unsigned i = 0; i < N; i++) {
#pragma HLS PIPELINE II=1
    buf[i] = in.read();
  }
}

// y[v][o] = b[o] + sum_i w[o][i] * x[v][i] for each of n_vec vectors.
template <class C>
void dense(hls::stream<typename C::in_t>& in, hls::stream<typename C::out_t>& out,
           const typename C::w_t w[C::n_out][C::n_in], const typename C::b_t b[C::n_out]) {
  static typename C::in_t x[C::n_in];
#pragma HLS ARRAY_PARTITION variable=x cyclic factor=C::simd
#pragma HLS ARRAY_PARTITION variable=w cyclic factor=C::pe dim=1
#pragma HLS ARRAY_PARTITION variable=w cyclic factor=C::simd dim=2
DenseVector:
  for (unsigned v = 0; v < C::n_vec; v++) {
    read_frame<typename C::in_t, C::n_in>(in, x);
  DenseNeuronFold:
    for (unsigned nf = 0; nf < C::n_out / C::pe; nf++) {
      typename C::acc_t acc[C::pe];
#pragma HLS ARRAY_PARTITION variable=acc complete
    DenseBias:
      for (unsigned p = 0; p < C::pe; p++) acc[p] = b[nf * C::pe + p];
    DenseSynapseFold:
      for (unsigned sf = 0; sf < C::n_in / C::simd; sf++) {
#pragma HLS PIPELINE II=C::mac_ii
      DensePE:
        for (unsigned p = 0; p < C::pe; p++) {
        DenseSIMD:
          for (unsigned s = 0; s < C::simd; s++) {
            const unsigned i = sf * C::simd + s;
            acc[p] += x[i] * w[nf * C::pe + p][i];
          }
        }
      }
    DenseWrite:
      for (unsigned p = 0; p < C::pe; p++) out.write(typename C::out_t(acc[p]));
    }
  }
}

// 2-D convolution, zero padding, stride, groups; w[oc][(ic_in_group*k_h + ky)*k_w + kx].
template <class C>
void conv2d(hls::stream<typename C::in_t>& in, hls::stream<typename C::out_t>& out,
            const typename C::w_t w[C::out_c][C::fan_in], const typename C::b_t b[C::out_c]) {
  static typename C::in_t x[C::in_c * C::in_h * C::in_w];
  static typename C::out_t y[C::out_c][C::out_h * C::out_w];
#pragma HLS ARRAY_PARTITION variable=x cyclic factor=C::simd
#pragma HLS ARRAY_PARTITION variable=y cyclic factor=C::pe dim=1
#pragma HLS ARRAY_PARTITION variable=w cyclic factor=C::pe dim=1
#pragma HLS ARRAY_PARTITION variable=w cyclic factor=C::simd dim=2
  read_frame<typename C::in_t, C::in_c * C::in_h * C::in_w>(in, x);
ConvPixel:
  for (unsigned px = 0; px < C::out_h * C::out_w; px++) {
    const int oy = px / C::out_w, ox = px % C::out_w;
  ConvNeuronFold:
    for (unsigned nf = 0; nf < C::out_c / C::pe; nf++) {
      typename C::acc_t acc[C::pe];
#pragma HLS ARRAY_PARTITION variable=acc complete
    ConvBias:
      for (unsigned p = 0; p < C::pe; p++) acc[p] = b[nf * C::pe + p];
    ConvSynapseFold:
      for (unsigned sf = 0; sf < C::fan_in / C::simd; sf++) {
#pragma HLS PIPELINE II=C::mac_ii
      ConvPE:
        for (unsigned p = 0; p < C::pe; p++) {
          const unsigned oc = nf * C::pe + p;
          const unsigned g = oc / (C::out_c / C::groups);
        ConvSIMD:
          for (unsigned s = 0; s < C::simd; s++) {
            const unsigned k = sf * C::simd + s;
            const unsigned ic = g * (C::in_c / C::groups) + k / (C::k_h * C::k_w);
            const int iy = oy * int(C::stride_h) + int((k / C::k_w) % C::k_h) - int(C::pad_h);
            const int ix = ox * int(C::stride_w) + int(k % C::k_w) - int(C::pad_w);
            const bool inside = iy >= 0 && iy < int(C::in_h) && ix >= 0 && ix < int(C::in_w);
            const typename C::in_t v =
                inside ? x[(ic * C::in_h + iy) * C::in_w + ix] : typename C::in_t(0);
            acc[p] += v * w[oc][k];
          }
        }
      }
    ConvStore:
      for (unsigned p = 0; p < C::pe; p++) y[nf * C::pe + p][px] = typename C::out_t(acc[p]);
    }
  }
ConvWriteChannel:
  for (unsigned oc = 0; oc < C::out_c; oc++) {
  ConvWritePixel:
    for (unsigned px = 0; px < C::out_h * C::out_w; px++) {
#pragma HLS PIPELINE II=1
      out.write(y[oc][px]);
    }
  }
}

// Per-channel affine y = x * s[c] + t[c] (a BatchNorm that could not be folded).
template <class C>
void scale(hls::stream<typename C::in_t>& in, hls::stream<typename C::out_t>& out,
           const typename C::w_t s[C::channels], const typename C::b_t t[C::channels]) {
ScaleChannel:
  for (unsigned c = 0; c < C::channels; c++) {
  ScaleElement:
    for (unsigned i = 0; i < C::spatial; i++) {
#pragma HLS PIPELINE II=1
      typename C::acc_t a = in.read() * s[c];
      a += t[c];
      out.write(typename C::out_t(a));
    }
  }
}

template <class C>
void relu(hls::stream<typename C::in_t>& in, hls::stream<typename C::out_t>& out) {
Relu:
  for (unsigned i = 0; i < C::n; i++) {
#pragma HLS PIPELINE II=1
    const typename C::in_t x = in.read();
    out.write(x > typename C::in_t(0) ? typename C::out_t(x) : typename C::out_t(0));
  }
}

template <class C>
void relu6(hls::stream<typename C::in_t>& in, hls::stream<typename C::out_t>& out) {
Relu6:
  for (unsigned i = 0; i < C::n; i++) {
#pragma HLS PIPELINE II=1
    const typename C::in_t x = in.read();
    const typename C::in_t lo = 0, hi = 6;
    out.write(typename C::out_t(x < lo ? lo : (x > hi ? hi : x)));
  }
}

// GELU in floating point: erf form, or torch's tanh approximation when C::tanh_approx.
template <class C>
void gelu(hls::stream<typename C::in_t>& in, hls::stream<typename C::out_t>& out) {
Gelu:
  for (unsigned i = 0; i < C::n; i++) {
#pragma HLS PIPELINE II=1
    const float x = in.read();
    const float inner = C::tanh_approx
        ? PIPECC_TANH(0.7978845608028654f * (x + 0.044715f * x * x * x))
        : PIPECC_ERF(x * 0.7071067811865476f);
    out.write(typename C::out_t(0.5f * x * (1.0f + inner)));
  }
}

// GELU in fixed point: table of gelu at x = -8 + k/64 (k = 0..1024), linear interpolation;
// gelu(x) = 0 below -8 and x from 8 up. Interpolation error <= max|gelu''| h^2/8 = 2e-5
// (h = 1/64), plus one LSB for the table's and the output's rounding.
template <class C>
void gelu_table(hls::stream<typename C::in_t>& in, hls::stream<typename C::out_t>& out,
                const typename C::out_t table[1025]) {
  typedef typename C::acc_t acc_t;
GeluTable:
  for (unsigned i = 0; i < C::n; i++) {
#pragma HLS PIPELINE II=1
    const typename C::in_t x = in.read();
    typename C::out_t y;
    if (x < typename C::in_t(-8)) {
      y = 0;
    } else if (x >= typename C::in_t(8)) {
      y = x;
    } else {
      const acc_t pos = (acc_t(x) + acc_t(8)) * acc_t(64);
      const unsigned k = pos.to_uint();
      const acc_t frac = pos - acc_t(k);
      y = typename C::out_t(acc_t(table[k]) + (acc_t(table[k + 1]) - acc_t(table[k])) * frac);
    }
    out.write(y);
  }
}

// Max / average pooling over k_h x k_w windows; padding is -inf (max) or zeros (avg).
template <class C, bool AVG>
void pool2d(hls::stream<typename C::in_t>& in, hls::stream<typename C::out_t>& out) {
  static typename C::in_t x[C::in_c * C::in_h * C::in_w];
  read_frame<typename C::in_t, C::in_c * C::in_h * C::in_w>(in, x);
PoolChannel:
  for (unsigned c = 0; c < C::in_c; c++) {
  PoolPixel:
    for (unsigned px = 0; px < C::out_h * C::out_w; px++) {
      const int oy = px / C::out_w, ox = px % C::out_w;
      typename C::acc_t acc = 0;
      typename C::in_t best = 0;
      unsigned count = 0;
    PoolWindow:
      for (unsigned k = 0; k < C::k_h * C::k_w; k++) {
#pragma HLS PIPELINE II=1
        const int iy = oy * int(C::stride_h) + int(k / C::k_w) - int(C::pad_h);
        const int ix = ox * int(C::stride_w) + int(k % C::k_w) - int(C::pad_w);
        if (iy >= 0 && iy < int(C::in_h) && ix >= 0 && ix < int(C::in_w)) {
          const typename C::in_t v = x[(c * C::in_h + iy) * C::in_w + ix];
          if (count == 0 || v > best) best = v;
          acc += v;
          count++;
        }
      }
      if (AVG) {
        const unsigned div = C::count_include_pad ? C::k_h * C::k_w : count;
        out.write(typename C::out_t(acc / typename C::acc_t(div)));
      } else {
        out.write(typename C::out_t(best));
      }
    }
  }
}

template <class C>
void maxpool2d(hls::stream<typename C::in_t>& in, hls::stream<typename C::out_t>& out) {
  pool2d<C, false>(in, out);
}

template <class C>
void avgpool2d(hls::stream<typename C::in_t>& in, hls::stream<typename C::out_t>& out) {
  pool2d<C, true>(in, out);
}

// torch's adaptive average pooling: bin i covers [floor(i*H/OH), ceil((i+1)*H/OH)).
template <class C>
void adaptive_avgpool2d(hls::stream<typename C::in_t>& in, hls::stream<typename C::out_t>& out) {
  static typename C::in_t x[C::in_c * C::in_h * C::in_w];
  read_frame<typename C::in_t, C::in_c * C::in_h * C::in_w>(in, x);
AdaptiveChannel:
  for (unsigned c = 0; c < C::in_c; c++) {
  AdaptivePixel:
    for (unsigned px = 0; px < C::out_h * C::out_w; px++) {
      const unsigned oy = px / C::out_w, ox = px % C::out_w;
      const unsigned y0 = oy * C::in_h / C::out_h, y1 = ((oy + 1) * C::in_h + C::out_h - 1) / C::out_h;
      const unsigned x0 = ox * C::in_w / C::out_w, x1 = ((ox + 1) * C::in_w + C::out_w - 1) / C::out_w;
      typename C::acc_t acc = 0;
    AdaptiveWindow:
      for (unsigned k = 0; k < C::bin_h * C::bin_w; k++) {
#pragma HLS PIPELINE II=1
        const unsigned iy = y0 + k / C::bin_w, ix = x0 + k % C::bin_w;
        if (iy < y1 && ix < x1) acc += x[(c * C::in_h + iy) * C::in_w + ix];
      }
      out.write(typename C::out_t(acc / typename C::acc_t((y1 - y0) * (x1 - x0))));
    }
  }
}

template <class C>
void add(hls::stream<typename C::in_t>& a, hls::stream<typename C::in_t>& b,
         hls::stream<typename C::out_t>& out) {
Add:
  for (unsigned i = 0; i < C::n; i++) {
#pragma HLS PIPELINE II=1
    const typename C::acc_t x = a.read();
    const typename C::acc_t y = b.read();
    out.write(typename C::out_t(x + y));
  }
}

// Concatenation along channels: in NCHW that is frame a, then frame b.
template <class C>
void concat(hls::stream<typename C::in_t>& a, hls::stream<typename C::in_t>& b,
            hls::stream<typename C::out_t>& out) {
ConcatFirst:
  for (unsigned i = 0; i < C::n_a; i++) {
#pragma HLS PIPELINE II=1
    out.write(a.read());
  }
ConcatSecond:
  for (unsigned i = 0; i < C::n_b; i++) {
#pragma HLS PIPELINE II=1
    out.write(b.read());
  }
}

template <class T>
void write_all(const T&) {}
template <class T, class S, class... Rest>
void write_all(const T& v, S& first, Rest&... rest) {
  first.write(v);
  write_all(v, rest...);
}

// Fan-out: a tensor read by several processes is copied into one FIFO per reader.
template <class T, unsigned N, class... S>
void clone(hls::stream<T>& in, S&... outs) {
Clone:
  for (unsigned i = 0; i < N; i++) {
#pragma HLS PIPELINE II=1
    write_all(in.read(), outs...);
  }
}

#ifndef __SYNTHESIS__
// C simulation loads weights from float32 little-endian .bin files (no huge initialisers).
template <class T>
bool load_weights(const char* dir, const char* file, T* dst, unsigned long n) {
  const std::string path = std::string(dir) + "/" + file;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) {
    std::fprintf(stderr, "pipecc: cannot open %s\n", path.c_str());
    return false;
  }
  std::vector<float> buf(n);
  const size_t got = std::fread(buf.data(), sizeof(float), n, f);
  std::fclose(f);
  if (got != n) {
    std::fprintf(stderr, "pipecc: %s holds %zu values, expected %lu\n", path.c_str(), got, n);
    return false;
  }
LoadWeights:
  for (unsigned long i = 0; i < n; i++) dst[i] = T(buf[i]);
  return true;
}
#endif

}  // namespace pipecc

#endif  // PIPECC_LAYERS_H
