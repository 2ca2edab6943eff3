"""The decoder of the cachegen codec's 4-lane rANS streams of quantized residuals, with dequantization fused in
(the stream format, its robustness contract and why the lanes are written out by hand: rans.py)."""
from __future__ import annotations

import numpy as np

from kvfabric.codec.cachegen.jit import SIG, jit, store
from kvfabric.codec.cachegen.rans import MASK, PB, RL, lane_channels, load_states


@jit(SIG.get("decode_lossy"))
def decode_lossy(words, pos, end, out, head, mus, steps, asteps, dflag, ja, ka, jd, kd, G, has_head, slots):  # noqa: ANN001, ANN201, E501
    """Decode one segment's words[pos:end] into out [H, T, D] (any strides): float32, or uint16 to receive fp16
    bits (rounded to nearest even, as a numpy cast would; no float32 pass). Returns True when the stream decoded
    exactly (all words used, all states back at 2^16); False means corrupt (out is garbage)."""
    H, T, D = out.shape
    C = H * D
    if end - pos < 8:
        return False
    x0, x1, x2, x3 = load_states(words, pos)
    pos += 8
    last = end - 1
    t0 = 1 if has_head else 0
    for c0 in range(0, C, 4):
        c1, c2, c3, live1, live2, live3 = lane_channels(c0, C)
        h0, d0 = c0 // D, c0 % D
        h1, d1 = c1 // D, c1 % D
        h2, d2 = c2 // D, c2 % D
        h3, d3 = c3 // D, c3 % D
        mu0, mu1, mu2, mu3 = mus[c0], mus[c1], mus[c2], mus[c3]
        dl0, dl1, dl2, dl3 = dflag[c0] != 0, dflag[c1] != 0, dflag[c2] != 0, dflag[c3] != 0
        r0, r1, r2, r3 = mu0, mu1, mu2, mu3
        ja0, ja1, ja2, ja3 = ja[c0], ja[c1], ja[c2], ja[c3]
        ka0, ka1, ka2, ka3 = ka[c0], ka[c1], ka[c2], ka[c3]
        jd0, jd1, jd2, jd3 = jd[c0], jd[c1], jd[c2], jd[c3]
        kd0, kd1, kd2, kd3 = kd[c0], kd[c1], kd[c2], kd[c3]
        as0, as1, as2, as3 = asteps[c0], asteps[c1], asteps[c2], asteps[c3]
        st0, st1, st2, st3 = steps[c0], steps[c1], steps[c2], steps[c3]
        if has_head:
            out[h0, 0, d0] = store(head[c0], out)
            if dl0:
                r0 = head[c0]
            if live1:
                out[h1, 0, d1] = store(head[c1], out)
                if dl1:
                    r1 = head[c1]
            if live2:
                out[h2, 0, d2] = store(head[c2], out)
                if dl2:
                    r2 = head[c2]
            if live3:
                out[h3, 0, d3] = store(head[c3], out)
                if dl3:
                    r3 = head[c3]
        v0 = v1 = v2 = v3 = np.float32(0.0)
        g = t0 % G
        for t in range(t0, T):
            anchor = g == 0
            g += 1
            if g == G:
                g = 0
            if anchor:
                J0, J1, J2, J3 = ja0, ja1, ja2, ja3
                K0, K1, K2, K3 = ka0, ka1, ka2, ka3
                S0, S1, S2, S3 = as0, as1, as2, as3
                B0, B1, B2, B3 = mu0, mu1, mu2, mu3
            else:
                J0, J1, J2, J3 = jd0, jd1, jd2, jd3
                K0, K1, K2, K3 = kd0, kd1, kd2, kd3
                S0, S1, S2, S3 = st0, st1, st2, st3
                B0, B1, B2, B3 = r0, r1, r2, r3
            e = np.int64(slots[J0, x0 & MASK])
            x0 = ((e >> 8) & 0xFFF) * (x0 >> PB) + (e >> 20)
            q = (e & 0xFF) - 128
            n = np.int64(x0 < RL)
            x0 = (x0 << (n << 4)) | (np.int64(words[min(pos, last)]) & -n)
            pos += n
            if q == -128:  # escape: 16 raw bits
                q = (x0 & 0xFFFF) - 32768
                x0 = x0 >> 16
                n = np.int64(x0 < RL)
                x0 = (x0 << (n << 4)) | (np.int64(words[min(pos, last)]) & -n)
                pos += n
            elif K0 > 0:  # k raw low bits
                q = (q << K0) + (x0 & ((1 << K0) - 1)) - (1 << (K0 - 1))
                x0 = x0 >> K0
                n = np.int64(x0 < RL)
                x0 = (x0 << (n << 4)) | (np.int64(words[min(pos, last)]) & -n)
                pos += n
            v0 = B0 + np.float32(q) * S0
            out[h0, t, d0] = store(v0, out)
            if live1:
                e = np.int64(slots[J1, x1 & MASK])
                x1 = ((e >> 8) & 0xFFF) * (x1 >> PB) + (e >> 20)
                q = (e & 0xFF) - 128
                n = np.int64(x1 < RL)
                x1 = (x1 << (n << 4)) | (np.int64(words[min(pos, last)]) & -n)
                pos += n
                if q == -128:  # escape: 16 raw bits
                    q = (x1 & 0xFFFF) - 32768
                    x1 = x1 >> 16
                    n = np.int64(x1 < RL)
                    x1 = (x1 << (n << 4)) | (np.int64(words[min(pos, last)]) & -n)
                    pos += n
                elif K1 > 0:  # k raw low bits
                    q = (q << K1) + (x1 & ((1 << K1) - 1)) - (1 << (K1 - 1))
                    x1 = x1 >> K1
                    n = np.int64(x1 < RL)
                    x1 = (x1 << (n << 4)) | (np.int64(words[min(pos, last)]) & -n)
                    pos += n
                v1 = B1 + np.float32(q) * S1
                out[h1, t, d1] = store(v1, out)
            if live2:
                e = np.int64(slots[J2, x2 & MASK])
                x2 = ((e >> 8) & 0xFFF) * (x2 >> PB) + (e >> 20)
                q = (e & 0xFF) - 128
                n = np.int64(x2 < RL)
                x2 = (x2 << (n << 4)) | (np.int64(words[min(pos, last)]) & -n)
                pos += n
                if q == -128:  # escape: 16 raw bits
                    q = (x2 & 0xFFFF) - 32768
                    x2 = x2 >> 16
                    n = np.int64(x2 < RL)
                    x2 = (x2 << (n << 4)) | (np.int64(words[min(pos, last)]) & -n)
                    pos += n
                elif K2 > 0:  # k raw low bits
                    q = (q << K2) + (x2 & ((1 << K2) - 1)) - (1 << (K2 - 1))
                    x2 = x2 >> K2
                    n = np.int64(x2 < RL)
                    x2 = (x2 << (n << 4)) | (np.int64(words[min(pos, last)]) & -n)
                    pos += n
                v2 = B2 + np.float32(q) * S2
                out[h2, t, d2] = store(v2, out)
            if live3:
                e = np.int64(slots[J3, x3 & MASK])
                x3 = ((e >> 8) & 0xFFF) * (x3 >> PB) + (e >> 20)
                q = (e & 0xFF) - 128
                n = np.int64(x3 < RL)
                x3 = (x3 << (n << 4)) | (np.int64(words[min(pos, last)]) & -n)
                pos += n
                if q == -128:  # escape: 16 raw bits
                    q = (x3 & 0xFFFF) - 32768
                    x3 = x3 >> 16
                    n = np.int64(x3 < RL)
                    x3 = (x3 << (n << 4)) | (np.int64(words[min(pos, last)]) & -n)
                    pos += n
                elif K3 > 0:  # k raw low bits
                    q = (q << K3) + (x3 & ((1 << K3) - 1)) - (1 << (K3 - 1))
                    x3 = x3 >> K3
                    n = np.int64(x3 < RL)
                    x3 = (x3 << (n << 4)) | (np.int64(words[min(pos, last)]) & -n)
                    pos += n
                v3 = B3 + np.float32(q) * S3
                out[h3, t, d3] = store(v3, out)
            if anchor:
                r0 = v0 if dl0 else mu0
                r1 = v1 if dl1 else mu1
                r2 = v2 if dl2 else mu2
                r3 = v3 if dl3 else mu3
        if pos > end:
            return False
    return pos == end and x0 == RL and x1 == RL and x2 == RL and x3 == RL

