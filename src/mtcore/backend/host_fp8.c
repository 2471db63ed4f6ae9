/* FP8 quantization and dequantization on the host CPU, one pass per direction.
 *
 * The spec is mtcore/ops/fp8.py (fp8_quantize, fp8_dequantize); these functions give
 * the same bits. mtcore/backend/host_fp8.py compiles this file once per machine and calls
 * it through ctypes. Plain C99 on contiguous row-major arrays, no torch headers, so it
 * compiles in under a second; the loops are written for the compiler to vectorise.
 *
 * A scaling unit is unit_rows x unit_cols elements of x [rows, cols] (the whole
 * tensor, a row, 1x128, 128x128, or, for the transposed operand of a GEMM, 128x1 or a
 * whole column). Its scale arrays are [ceil(rows/unit_rows), ceil(cols/unit_cols)],
 * or the transpose of that when the data is written transposed.
 */
#include <float.h>
#include <stdint.h>
#include <string.h>

enum { FORMAT_E4M3 = 0, FORMAT_E5M2 = 1 };
enum { TILE = 16 }; /* rows quantized at a time before their bytes are transposed */

static inline float float_of_bits(uint32_t bits) {
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline uint32_t bits_of_float(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    return bits;
}

/* |x| as float32 bits: for non-negative floats the bits order as the values do, so an
 * amax is an unsigned integer max, which vectorises (a float max that keeps NaN does not). */
static inline uint32_t magnitude_bits(const void *x, int x_bf16, int64_t index) {
    if (x_bf16) return (uint32_t)(((const uint16_t *)x)[index] & 0x7FFFu) << 16;
    return bits_of_float(((const float *)x)[index]) & 0x7FFFFFFFu;
}

static inline float load(const void *x, int x_bf16, int64_t index) {
    if (x_bf16) return float_of_bits((uint32_t)((const uint16_t *)x)[index] << 16);
    return ((const float *)x)[index];
}

/* A float32 within the format's range, rounded to nearest even. Below the smallest
 * normal the format's subnormals are multiples of one step: adding and subtracting
 * 2**23 rounds |v| / step to an integer. Above it the float32 mantissa is rounded to the
 * format's bits (a carry moves into the exponent) and the exponent rebiased. */
static inline uint8_t round_e4m3(float value) {
    uint32_t bits = bits_of_float(value), sign = (bits >> 24) & 0x80u, mag = bits & 0x7FFFFFFFu;
    float steps = float_of_bits(mag) * 512.0f; /* subnormal step 2**-9 */
    steps = (steps + 8388608.0f) - 8388608.0f;
    uint32_t subnormal = (uint32_t)(int32_t)steps;
    uint32_t normal = ((mag + 0x7FFFFu + ((mag >> 20) & 1u)) >> 20) - (120u << 3);
    return (uint8_t)((mag < 0x3C800000u ? subnormal : normal) | sign); /* 2**-6 */
}

static inline uint8_t round_e5m2(float value) {
    uint32_t bits = bits_of_float(value), sign = (bits >> 24) & 0x80u, mag = bits & 0x7FFFFFFFu;
    float steps = float_of_bits(mag) * 65536.0f; /* subnormal step 2**-16 */
    steps = (steps + 8388608.0f) - 8388608.0f;
    uint32_t subnormal = (uint32_t)(int32_t)steps;
    uint32_t normal = ((mag + 0xFFFFFu + ((mag >> 21) & 1u)) >> 21) - (112u << 2);
    return (uint8_t)((mag < 0x38800000u ? subnormal : normal) | sign); /* 2**-14 */
}

/* fmax / amax as torch computes a scalar over a tensor (reciprocal, then product),
 * 1 where amax is 0, at most the largest float32. */
static inline float scale_of(float amax, float fmax) {
    if (!(amax > 0.0f)) return 1.0f;
    float scale = (1.0f / amax) * fmax;
    return scale > FLT_MAX ? FLT_MAX : scale;
}

static inline float clamped(float value, float fmax) {
    return value > fmax ? fmax : (value < -fmax ? -fmax : value);
}

/* One row's quantized bytes, each element scaled by its unit's scale (unit_cols == 1:
 * a scale per column). */
static void quantize_row(const void *x, int x_bf16, int64_t start, int64_t cols, int64_t unit_cols,
                         const float *scales, int format, float fmax, uint8_t *out) {
    if (unit_cols == 1) {
        if (format == FORMAT_E5M2)
            for (int64_t k = 0; k < cols; k++)
                out[k] = round_e5m2(clamped(load(x, x_bf16, start + k) * scales[k], fmax));
        else
            for (int64_t k = 0; k < cols; k++)
                out[k] = round_e4m3(clamped(load(x, x_bf16, start + k) * scales[k], fmax));
        return;
    }
    for (int64_t first = 0; first < cols; first += unit_cols) {
        int64_t last = first + unit_cols < cols ? first + unit_cols : cols;
        float scale = scales[first / unit_cols];
        if (format == FORMAT_E5M2)
            for (int64_t k = first; k < last; k++)
                out[k] = round_e5m2(clamped(load(x, x_bf16, start + k) * scale, fmax));
        else
            for (int64_t k = first; k < last; k++)
                out[k] = round_e4m3(clamped(load(x, x_bf16, start + k) * scale, fmax));
    }
}

#if defined(__SSE2__)
#include <emmintrin.h>
/* A 16 x 16 byte block transposed: four rounds of interleaving row i with row i + 8
 * (a perfect shuffle each; four of them transpose 16 x 16). */
static inline void transpose_block(const uint8_t *src, int64_t src_stride, uint8_t *dst,
                                   int64_t dst_stride) {
    __m128i rows[TILE], mixed[TILE];
    for (int i = 0; i < TILE; i++) rows[i] = _mm_loadu_si128((const __m128i *)(src + i * src_stride));
    for (int round = 0; round < 4; round++) {
        for (int i = 0; i < TILE / 2; i++) {
            mixed[2 * i] = _mm_unpacklo_epi8(rows[i], rows[i + TILE / 2]);
            mixed[2 * i + 1] = _mm_unpackhi_epi8(rows[i], rows[i + TILE / 2]);
        }
        memcpy(rows, mixed, sizeof rows);
    }
    for (int i = 0; i < TILE; i++) _mm_storeu_si128((__m128i *)(dst + i * dst_stride), rows[i]);
}
#endif

/* tile [count, cols] bytes into columns of out [cols, stride]. */
static void transpose_tile(const uint8_t *tile, int64_t count, int64_t cols, uint8_t *out,
                           int64_t stride) {
    int64_t k0 = 0;
#if defined(__SSE2__)
    if (count == TILE)
        for (; k0 + TILE <= cols; k0 += TILE) transpose_block(tile + k0, cols, out + k0 * stride, stride);
#endif
    for (int64_t k = k0; k < cols; k++)
        for (int64_t r = 0; r < count; r++) out[k * stride + r] = tile[r * cols + k];
}

/* Quantize x [rows, cols] (float32, or bfloat16 when x_bf16) with one scale per unit.
 *
 * given_scale: one scale for the whole tensor (delayed scaling) or NULL.
 * out: [rows, cols] bytes, or [cols, rows] when transpose_out.
 * scale_inv, amax: [units down, units across] float32, or [across, down] when
 *   transpose_out. work: 2 * across + TILE * cols / 4 floats.
 *
 * One band of unit_rows rows at a time: its units' amax, then its bytes, while the band
 * is still in cache (a band of 128 rows of a few hundred bfloat16 columns fits in L2). */
void mtcore_fp8_quantize(const void *x, int x_bf16, int64_t rows, int64_t cols, int format,
                         float fmax, int64_t unit_rows, int64_t unit_cols,
                         const float *given_scale, uint8_t *out, int transpose_out,
                         float *scale_inv, float *amax, float *work) {
    int64_t down = (rows + unit_rows - 1) / unit_rows, across = (cols + unit_cols - 1) / unit_cols;
    uint32_t *unit_max = (uint32_t *)work; /* one band's units */
    float *scales = work + across;
    uint8_t *tile = (uint8_t *)(scales + across);
    for (int64_t d = 0; d < down; d++) {
        int64_t band = d * unit_rows, band_end = band + unit_rows < rows ? band + unit_rows : rows;
        memset(unit_max, 0, (size_t)across * sizeof *unit_max);
        for (int64_t m = band; m < band_end; m++) {
            const int64_t start = m * cols;
            if (unit_cols == 1) {
                for (int64_t k = 0; k < cols; k++) {
                    uint32_t bits = magnitude_bits(x, x_bf16, start + k);
                    unit_max[k] = unit_max[k] > bits ? unit_max[k] : bits;
                }
                continue;
            }
            for (int64_t first = 0, a = 0; first < cols; first += unit_cols, a++) {
                int64_t last = first + unit_cols < cols ? first + unit_cols : cols;
                uint32_t most = 0;
                for (int64_t k = first; k < last; k++) {
                    uint32_t bits = magnitude_bits(x, x_bf16, start + k);
                    most = most > bits ? most : bits;
                }
                unit_max[a] = unit_max[a] > most ? unit_max[a] : most;
            }
        }
        for (int64_t a = 0; a < across; a++) {
            int64_t kept = transpose_out ? a * down + d : d * across + a;
            float unit_amax = float_of_bits(unit_max[a]);
            float scale = given_scale ? *given_scale : scale_of(unit_amax, fmax);
            scales[a] = scale;
            amax[kept] = unit_amax;
            scale_inv[kept] = 1.0f / scale;
        }
        if (!transpose_out) {
            for (int64_t m = band; m < band_end; m++)
                quantize_row(x, x_bf16, m * cols, cols, unit_cols, scales, format, fmax,
                             out + m * cols);
            continue;
        }
        for (int64_t m0 = band; m0 < band_end; m0 += TILE) {
            int64_t count = band_end - m0 < TILE ? band_end - m0 : TILE;
            for (int64_t r = 0; r < count; r++)
                quantize_row(x, x_bf16, (m0 + r) * cols, cols, unit_cols, scales, format, fmax,
                             tile + r * cols);
            transpose_tile(tile, count, cols, out + m0, rows);
        }
    }
}

/* An FP8 byte's value as float32, exactly, without a table look-up (a gather does not
 * vectorise well): the byte's exponent and mantissa bits placed at the top of a float32's
 * give the value times 2**-120 (E4M3) or 2**-112 (E5M2), subnormals included (they become
 * float32 subnormals of the same significand), and the product restores it exactly. */
static inline float value_e4m3(uint8_t byte) {
    uint32_t magnitude = byte & 0x7Fu, sign = (uint32_t)(byte & 0x80u) << 24;
    float value = float_of_bits(magnitude << 20) * 0x1p120f;
    uint32_t bits = magnitude == 0x7Fu ? 0x7FC00000u : bits_of_float(value); /* S.1111.111 */
    return float_of_bits(bits | sign);
}

static inline float value_e5m2(uint8_t byte) {
    uint32_t magnitude = byte & 0x7Fu, sign = (uint32_t)(byte & 0x80u) << 24;
    float value = float_of_bits(magnitude << 21) * 0x1p112f;
    /* exponent 11111: infinity (mantissa 0) or NaN */
    uint32_t special = 0x7F800000u | ((magnitude & 3u) << 21);
    uint32_t bits = magnitude >= 0x7Cu ? special : bits_of_float(value);
    return float_of_bits(bits | sign);
}

static inline uint16_t round_bf16(float value) {
    uint32_t bits = bits_of_float(value);
    uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return (uint16_t)(value != value ? 0x7FC0u : rounded);
}

/* out [rows, cols] = the FP8 value of data * scale_inv of the element's unit, rounded once
 * to bfloat16 (nearest even) when out_bf16, else float32. */
void mtcore_fp8_dequantize(const uint8_t *data, int64_t rows, int64_t cols, int format,
                           const float *scale_inv, int64_t unit_rows, int64_t unit_cols,
                           int out_bf16, void *out) {
    int64_t across = (cols + unit_cols - 1) / unit_cols;
    for (int64_t m = 0; m < rows; m++) {
        const float *row_scales = scale_inv + (m / unit_rows) * across;
        const uint8_t *bytes = data + m * cols;
        uint16_t *row_bf16 = (uint16_t *)out + m * cols;
        float *row_f32 = (float *)out + m * cols;
        for (int64_t first = 0; first < cols; first += unit_cols) {
            int64_t last = first + unit_cols < cols ? first + unit_cols : cols;
            float scale = row_scales[first / unit_cols];
            if (format == FORMAT_E4M3 && out_bf16)
                for (int64_t k = first; k < last; k++)
                    row_bf16[k] = round_bf16(value_e4m3(bytes[k]) * scale);
            else if (format == FORMAT_E4M3)
                for (int64_t k = first; k < last; k++) row_f32[k] = value_e4m3(bytes[k]) * scale;
            else if (out_bf16)
                for (int64_t k = first; k < last; k++)
                    row_bf16[k] = round_bf16(value_e5m2(bytes[k]) * scale);
            else
                for (int64_t k = first; k < last; k++) row_f32[k] = value_e5m2(bytes[k]) * scale;
        }
    }
}
