// pipecc beat packing (Apache-2.0). The one C++ definition of how a tensor travels over a
// stage port; backends/fpga/pack.py is the Python twin and tests check they agree.
//
// A frame (one sample's tensor, torch NCHW order) is a bit string: element k occupies bits
// [k*BITS, (k+1)*BITS) as its raw word (float: IEEE-754 pattern; ap_fixed<W,I>: W-bit two's
// complement). Beat j carries bits [j*LINK, (j+1)*LINK); elements may straddle two beats.
// Beats per frame = ceil(N*BITS / LINK) by integer ceil-division: the tail is zero-padded,
// never dropped. On the host a beat is LINK/64 little-endian uint64 words (word 0 = bits 0..63).
#ifndef PIPECC_PACK_H
#define PIPECC_PACK_H

#include <stdint.h>
#include "ap_fixed.h"
#include "ap_int.h"
#include "hls_stream.h"

namespace pipecc {

template <class T>
struct raw_bits;

template <>
struct raw_bits<float> {
  static const int width = 32;
  static ap_uint<32> to(float v) {
    union { float f; uint32_t u; } c;
    c.f = v;
    return c.u;
  }
  static float from(const ap_uint<32>& r) {
    union { float f; uint32_t u; } c;
    c.u = (uint32_t)r.to_uint();
    return c.f;
  }
};

template <int W, int I, ap_q_mode Q, ap_o_mode O, int N>
struct raw_bits<ap_fixed<W, I, Q, O, N> > {
  static const int width = W;
  static ap_uint<W> to(const ap_fixed<W, I, Q, O, N>& v) { return v.range(W - 1, 0); }
  static ap_fixed<W, I, Q, O, N> from(const ap_uint<W>& r) {
    ap_fixed<W, I, Q, O, N> v;
    v.range(W - 1, 0) = r;
    return v;
  }
};

template <unsigned long long N, unsigned BITS, unsigned LINK>
struct frame_beats {
  static const unsigned long long value = (N * BITS + LINK - 1) / LINK;
};

// Values in, beats out: ceil(N*BITS/LINK) beats, the last one zero-padded.
template <class T, unsigned N, unsigned LINK>
void pack_frame(hls::stream<T>& in, hls::stream<ap_uint<LINK> >& out) {
  const unsigned BITS = raw_bits<T>::width;
  ap_uint<LINK + BITS> acc = 0;
  unsigned fill = 0;
PackFrame:
  for (unsigned i = 0; i < N; i++) {
#pragma HLS PIPELINE II=1
    acc |= ap_uint<LINK + BITS>(raw_bits<T>::to(in.read())) << fill;
    fill += BITS;
    if (fill >= LINK) {
      out.write(ap_uint<LINK>(acc.range(LINK - 1, 0)));
      acc >>= LINK;
      fill -= LINK;
    }
  }
  if (fill > 0) out.write(ap_uint<LINK>(acc.range(LINK - 1, 0)));  // the tail beat
}

// Beats in, values out: reads exactly ceil(N*BITS/LINK) beats.
template <class T, unsigned N, unsigned LINK>
void unpack_frame(hls::stream<ap_uint<LINK> >& in, hls::stream<T>& out) {
  const unsigned BITS = raw_bits<T>::width;
  ap_uint<LINK + BITS> acc = 0;
  unsigned fill = 0;
UnpackFrame:
  for (unsigned i = 0; i < N; i++) {
#pragma HLS PIPELINE II=1
    if (fill < BITS) {
      acc |= ap_uint<LINK + BITS>(in.read()) << fill;
      fill += LINK;
    }
    out.write(raw_bits<T>::from(ap_uint<BITS>(acc.range(BITS - 1, 0))));
    acc >>= BITS;
    fill -= BITS;
  }
}

#ifndef __SYNTHESIS__
// Host side (C simulation only): a beat <-> LINK/64 little-endian uint64 words.
template <unsigned LINK>
ap_uint<LINK> beat_from_words(const uint64_t* words) {
  ap_uint<LINK> beat = 0;
BeatFromWords:
  for (unsigned k = 0; k < LINK / 64; k++) beat |= ap_uint<LINK>(words[k]) << (64 * k);
  return beat;
}

template <unsigned LINK>
void beat_to_words(const ap_uint<LINK>& beat, uint64_t* words) {
BeatToWords:
  for (unsigned k = 0; k < LINK / 64; k++) words[k] = (uint64_t)(beat >> (64 * k)).to_uint64();
}

inline float to_float(float v) { return v; }
template <int W, int I, ap_q_mode Q, ap_o_mode O, int N>
float to_float(const ap_fixed<W, I, Q, O, N>& v) { return v.to_float(); }
#endif

}  // namespace pipecc

#endif  // PIPECC_PACK_H
