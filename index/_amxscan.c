/* The fused int8 MaxSim scans, on AMX tiles (ep_amx_docmax), on AVX-512 VNNI (ep_vnni_docmax)
 * and on AVX2 (ep_avx2_docmax); index/amxscan.py is their Python side and their documentation (why they
 * are hand-written is said there).
 *
 * ep_amx_docmax: for every document D (rows starts[d]..ends[d]-1 of the int8 codes) and every
 * query column i (n_ib groups of 16), the largest over D's rows j of
 *     s_j * (sum_l w_l * <k_{l,i}, c_j>)
 * where <.,.> is an exact int8 x int8 -> int32 product (AMX TDPBSSD), k_l the query's l-th int8
 * codes (packed by the Python side into the tiles' B layout) and s_j the row's float32 scale.
 * The products never leave the tiles and a 16-row buffer: the per-document maximum is taken as
 * they are made, so no [m, T] array is written to memory.
 *
 * An extension module with no Python functions: its module is empty (so that importing it, as
 * tools that walk the package do, works); the Python side finds its file and loads it with
 * ctypes, whose calls release the GIL (the scan's worker threads run the kernel in parallel).
 *
 * The library carries AMX, AVX-512 and AVX2 instructions only inside functions marked with a
 * target attribute; nothing runs them unless the caller saw the unit in the CPU's flags
 * (amx_int8, avx512_vnni with BW/DQ/VL, or avx2 with fma) and, for AMX, asked Linux for the tile state
 * (ep_amx_request).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* Ask Linux for the AMX tile state of this process (every thread): 0 when granted. */
int ep_amx_request(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

#define TARGET __attribute__((target("amx-tile,amx-int8,avx512f,avx512bw,avx512dq,avx512vl,fma")))

/* The AMX kernel: a document's maxima dm[0..mp) (mp a multiple of 16) to dst, dm reset. */
__attribute__((target("avx512f"))) static inline void flush(float *dst, float *dm, int mp) {
    const __m512 lowest = _mm512_set1_ps(-__builtin_inff());
    for (int g = 0; g < mp; g += 16) {
        _mm512_storeu_ps(dst + g, _mm512_loadu_ps(dm + g));
        _mm512_storeu_ps(dm + g, lowest);
    }
}

/* All kernels: the end of the run of documents from d whose rows follow each other (a block
 * of rows may cross documents within a run). */
static inline int64_t run_end(const int64_t *starts, const int64_t *ends, int64_t n_docs, int64_t d) {
    int64_t e = d + 1;
    while (e < n_docs && starts[e] == ends[e - 1]) e++;
    return e;
}

/* The VNNI and AVX2 kernels: a document's maxima dm[0..mp) to dst, dm reset (once per document:
 * plain C, no target needed). */
static inline void flush_doc(float *dst, float *dm, int mp) {
    memcpy(dst, dm, (size_t)mp * sizeof(float));
    for (int i = 0; i < mp; i++) dm[i] = -__builtin_inff();
}

/* The VNNI and AVX2 kernels: the codes of the block of rows r.. (nr of them, read as `rows` rows
 * of kpad bytes), row stride *stride: in place, or for the last rows of the array, whose reads
 * would pass its end, a zero-padded copy in pad (pad_bytes). */
static inline const int8_t *block_codes(const int8_t *codes, int64_t dim, int64_t total, int64_t r, int nr,
                                        int rows, int64_t kpad, int8_t *pad, size_t pad_bytes, int64_t *stride) {
    *stride = dim;
    if ((r + rows - 1) * dim + kpad <= total) return codes + r * dim;
    memset(pad, 0, pad_bytes);
    for (int i = 0; i < nr; i++) memcpy(pad + i * kpad, codes + (r + i) * dim, (size_t)dim);
    *stride = kpad;
    return pad;
}

/* The VNNI and AVX2 kernels: from row i of the block starting at row r (nr rows), the end j of
 * the rows that belong to one document, *cur (the documents that end before row r + i are
 * written out first). */
static inline int segment(const int64_t *ends, int64_t r, int nr, int i, int64_t *cur, float *out, float *dm, int mp) {
    while (r + i >= ends[*cur]) {
        flush_doc(out + *cur * mp, dm, mp);
        (*cur)++;
    }
    return (int)(ends[*cur] - r < nr ? ends[*cur] - r : nr);
}

/* Returns 0, or -1 when a buffer could not be allocated (out is then undefined).
 *   codes   int8 [n_rows, dim] (row stride dim bytes); scales float32 [n_rows] or NULL (1.0)
 *   starts, ends  int64 [n_docs]: each document's rows (non-empty)
 *   qpack   int8 [n_ib][n_codes][n_kb][16][64]: query codes in the B-tile layout (zero padded)
 *   w       float32 [n_codes]: each code's weight (1, 1/254, 1/254^2; the first is taken as 1)
 *   out     float32 [n_docs][16 * n_ib]                                                      */
TARGET int ep_amx_docmax(const int8_t *codes, int64_t n_rows, int64_t dim, const float *scales,
                         const int64_t *starts, const int64_t *ends, int64_t n_docs,
                         const int8_t *qpack, int n_ib, int n_codes, int n_kb, const float *w,
                         float *out) {
    if (n_codes < 1 || n_codes > 3 || n_ib < 1 || n_kb < 1) return -1;
    const int mp = 16 * n_ib;
    const int64_t kpad = 64 * (int64_t)n_kb;
    int32_t *cbuf = aligned_alloc(64, (size_t)n_ib * 3 * 16 * 16 * sizeof(int32_t));
    float *dm = aligned_alloc(64, (size_t)mp * sizeof(float));
    int8_t *pad = aligned_alloc(64, (size_t)16 * kpad);
    if (!cbuf || !dm || !pad) {
        free(cbuf); free(dm); free(pad);
        return -1;
    }
    for (int i = 0; i < mp; i++) dm[i] = -__builtin_inff();

    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    /* tiles 0-2: int32 accumulators (16 rows x 16 query columns); 4: A, 16 code rows x 64 bytes;
     * 5-7: B, the query codes of one level (16 rows of 4-byte groups x 16 columns) */
    const int used[] = {0, 1, 2, 4, 5, 6, 7};
    for (unsigned t = 0; t < sizeof used / sizeof used[0]; t++) {
        cfg.rows[used[t]] = 16;
        cfg.colsb[used[t]] = 64;
    }
    _tile_loadconfig(&cfg);

    const __m512 w1 = _mm512_set1_ps(n_codes > 1 ? w[1] : 0.0f);
    const __m512 w2 = _mm512_set1_ps(n_codes > 2 ? w[2] : 0.0f);
    const int64_t total = n_rows * dim; /* bytes of codes that may be read */

    for (int64_t d = 0, e; d < n_docs; d = e) {
        e = run_end(starts, ends, n_docs, d);
        const int64_t r0 = starts[d], r1 = ends[e - 1];
        int64_t cur = d;
        for (int64_t r = r0; r < r1; r += 16) {
            const int nr = (int)(r1 - r < 16 ? r1 - r : 16);
            const int8_t *a = codes + r * dim;
            int64_t stride = dim;
            if ((r + 15) * dim + kpad > total) { /* the last rows: read a zero-padded copy */
                memset(pad, 0, (size_t)16 * kpad);
                for (int i = 0; i < nr; i++) memcpy(pad + i * kpad, codes + (r + i) * dim, (size_t)dim);
                a = pad;
                stride = kpad;
            }
            for (int g = 0; g < n_ib; g++) {
                const int8_t *b = qpack + (int64_t)g * n_codes * n_kb * 1024;
                int32_t *c = cbuf + g * 3 * 256;
                _tile_zero(0);
                if (n_codes > 1) _tile_zero(1);
                if (n_codes > 2) _tile_zero(2);
                for (int kb = 0; kb < n_kb; kb++) {
                    _tile_loadd(4, a + 64 * kb, stride);
                    _tile_loadd(5, b + (int64_t)kb * 1024, 64);
                    _tile_dpbssd(0, 4, 5);
                    if (n_codes > 1) {
                        _tile_loadd(6, b + (int64_t)(n_kb + kb) * 1024, 64);
                        _tile_dpbssd(1, 4, 6);
                    }
                    if (n_codes > 2) {
                        _tile_loadd(7, b + (int64_t)(2 * n_kb + kb) * 1024, 64);
                        _tile_dpbssd(2, 4, 7);
                    }
                }
                _tile_stored(0, c, 64);
                if (n_codes > 1) _tile_stored(1, c + 256, 64);
                if (n_codes > 2) _tile_stored(2, c + 512, 64);
            }
            /* the block's rows, one document's segment at a time: the segment's maxima are
             * taken in registers and merged into the document's once */
            for (int i = 0; i < nr;) {
                while (r + i >= ends[cur]) { /* the rows of document cur are done */
                    flush(out + cur * mp, dm, mp);
                    cur++;
                }
                const int j = (int)(ends[cur] - r < nr ? ends[cur] - r : nr); /* rows i..j-1: cur's */
                for (int g = 0; g < n_ib; g++) {
                    const int32_t *c = cbuf + g * 3 * 256;
                    __m512 acc = _mm512_loadu_ps(dm + 16 * g);
                    for (int t = i; t < j; t++) {
                        __m512 v = _mm512_cvtepi32_ps(_mm512_loadu_si512(c + 16 * t));
                        if (n_codes > 1) v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c + 256 + 16 * t)), w1, v);
                        if (n_codes > 2) v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(c + 512 + 16 * t)), w2, v);
                        const float s = scales ? scales[r + t] : 1.0f;
                        acc = _mm512_max_ps(acc, _mm512_mul_ps(v, _mm512_set1_ps(s)));
                    }
                    _mm512_storeu_ps(dm + 16 * g, acc);
                }
                i = j;
            }
        }
        for (; cur < e; cur++) flush(out + cur * mp, dm, mp);
    }
    _tile_release();
    free(cbuf); free(dm); free(pad);
    return 0;
}

/* ep_vnni_docmax: the same per-document maxima as ep_amx_docmax on AVX-512 VNNI (VPDPBUSD),
 * for CPUs without AMX. VPDPBUSD multiplies unsigned bytes (its register operand) by signed
 * bytes (the operand it can broadcast from memory), so here the query is the unsigned side,
 * its codes shifted by 128 (k + 128 in 1..255), and each code row is the signed side, one
 * 4-byte group broadcast to 16 lanes straight from the mapped codes (no copy, no shuffle):
 *     sum_k (q_k + 128) c_k = <q, c> + 128 sum_k c_k,
 * and the row's sum of codes (VPDPBUSD with ones, exact) takes the 128 sum_k c_k back out, so
 * the int32 per (row, query column) are the ones TDPBSSD gives. A block of 8 rows (contiguous
 * codes) is multiplied by 32 query columns at a time: 16 int32 accumulators in registers, two
 * query vectors per 4-byte group shared by the 8 rows, the codes of the block PF blocks ahead
 * prefetched as it goes (without it the loop waited on memory a third of its time). The int32
 * go to a small buffer and are combined, scaled and folded into per-document maxima.
 *   qpack  uint8 [n_cg][n_codes][n_g][32][4]: per group of 32 query columns, level and 4-byte
 *          group of components, the 32 columns' 4 codes + 128 (0 for padding columns/components)
 *   out    float32 [n_docs][32 * n_cg]                                                       */
#define VTARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma")))
#define VR 8  /* rows per block: 16 accumulators (12 rows measured no faster, and spilled addresses) */
#define VROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define PF 4  /* blocks ahead to prefetch */

/* acc += VPDPBUSD(u, s), in place: GCC (12) compiles _mm512_dpbusd_epi32 in an unrolled loop
 * with register copies around the instructions */
#define DPBUSD(acc, u, s) __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(u), "v"(s))

VTARGET static inline __m512i bcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

VTARGET int ep_vnni_docmax(const int8_t *codes, int64_t n_rows, int64_t dim, const float *scales,
                           const int64_t *starts, const int64_t *ends, int64_t n_docs,
                           const uint8_t *qpack, int n_cg, int n_codes, int n_g, const float *w,
                           float *out) {
    if (n_codes < 1 || n_codes > 3 || n_cg < 1 || n_g < 1 || 4 * (int64_t)n_g < dim) return -1;
    const int mp = 32 * n_cg;
    const int64_t kpad = 4 * (int64_t)n_g;
    /* the block's int32: [level][column group][row][32 columns] */
    int32_t *cbuf = aligned_alloc(64, (size_t)n_codes * n_cg * VR * 32 * sizeof(int32_t));
    float *dm = aligned_alloc(64, (size_t)mp * sizeof(float));
    int8_t *pad = aligned_alloc(64, (size_t)VR * kpad + 64);
    if (!cbuf || !dm || !pad) {
        free(cbuf); free(dm); free(pad);
        return -1;
    }
    for (int i = 0; i < mp; i++) dm[i] = -__builtin_inff();
    const int64_t total = n_rows * dim;
    const int n_chunks = (int)((dim + 63) / 64);
    const __mmask64 tail = dim % 64 ? (((__mmask64)1 << (dim % 64)) - 1) : ~(__mmask64)0;
    const __m512i zero = _mm512_setzero_si512(), ones = _mm512_set1_epi8(1);
    const __m512 wv1 = _mm512_set1_ps(n_codes > 1 ? w[1] : 0.0f), wv2 = _mm512_set1_ps(n_codes > 2 ? w[2] : 0.0f);
    const int64_t level_stride = (int64_t)n_cg * VR * 32;
    __m512i corr[VR];
    __m512 scale[VR];

    for (int64_t d = 0, e; d < n_docs; d = e) {
        e = run_end(starts, ends, n_docs, d);
        const int64_t r0 = starts[d], r1 = ends[e - 1];
        int64_t cur = d;
        for (int64_t r = r0; r < r1; r += VR) {
            const int nr = (int)(r1 - r < VR ? r1 - r : VR);
            int64_t stride;
            const int8_t *a = block_codes(codes, dim, total, r, nr, VR, kpad, pad, (size_t)VR * kpad + 64, &stride);
            /* prefetching is a hint (past the last blocks it re-reads the first ones) */
            const int64_t ahead = (r + PF * VR) * dim;
            const char *pf = (const char *)(codes + (ahead + VR * kpad <= total ? ahead : 0));
            for (int t = 0; t < VR; t++) { /* each row's sum of codes (ones x codes), its scale */
                __m512i sum = zero;
                const int8_t *p = a + t * stride;
                for (int c = 0; c < n_chunks; c++) {
                    const __m512i x = _mm512_maskz_loadu_epi8(c == n_chunks - 1 ? tail : ~(__mmask64)0, p + 64 * c);
                    DPBUSD(sum, ones, x);
                }
                corr[t] = _mm512_set1_epi32(128 * _mm512_reduce_add_epi32(sum));
                scale[t] = _mm512_set1_ps(scales && t < nr ? scales[r + t] : 1.0f);
            }
            for (int cg = 0; cg < n_cg; cg++) {
                for (int l = 0; l < n_codes; l++) {
                    const uint8_t *q = qpack + ((int64_t)cg * n_codes + l) * n_g * 128;
#define DECL(T) __m512i a##T##0 = zero, a##T##1 = zero;
                    VROWS(DECL)
#undef DECL
                    const int8_t *p = a;
                    for (int g = 0; g < n_g; g++, q += 128, p += 4) {
                        _mm_prefetch(pf + 4 * VR * g, _MM_HINT_T0); /* 4 n_g >= dim: the whole block */
                        const __m512i q0 = _mm512_loadu_si512(q), q1 = _mm512_loadu_si512(q + 64);
                        __m512i b;
#define STEP(T) b = bcast(p + T * stride); DPBUSD(a##T##0, q0, b); DPBUSD(a##T##1, q1, b);
                        VROWS(STEP)
#undef STEP
                    }
                    int32_t *c = cbuf + l * level_stride + cg * VR * 32;
#define KEEP(T) _mm512_store_si512(c + 32 * T, a##T##0); _mm512_store_si512(c + 32 * T + 16, a##T##1);
                    VROWS(KEEP)
#undef KEEP
                }
            }
            /* the block's rows, one document's segment at a time, folded into its maxima */
            for (int i = 0, j; i < nr; i = j) {
                j = segment(ends, r, nr, i, &cur, out, dm, mp);
                for (int o = 0; o < mp; o += 16) { /* o: column; its block offset (o / 32) * VR * 32 + o % 32 */
                    const int32_t *c = cbuf + (o / 32) * VR * 32 + o % 32;
                    __m512 acc = _mm512_loadu_ps(dm + o);
                    for (int t = i; t < j; t++) {
                        __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c + 32 * t), corr[t]));
                        if (n_codes > 1) v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c + level_stride + 32 * t), corr[t])), wv1, v);
                        if (n_codes > 2) v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(c + 2 * level_stride + 32 * t), corr[t])), wv2, v);
                        acc = _mm512_max_ps(acc, _mm512_mul_ps(v, scale[t]));
                    }
                    _mm512_storeu_ps(dm + o, acc);
                }
            }
        }
        for (; cur < e; cur++) flush_doc(out + cur * mp, dm, mp);
    }
    free(cbuf); free(dm); free(pad);
    return 0;
}

/* ep_avx2_docmax: the same per-document maxima on AVX2 (VPMADDUBSW + VPMADDWD), for CPUs with
 * neither AMX nor AVX-512 VNNI. VPMADDUBSW multiplies unsigned bytes by signed bytes and adds
 * adjacent pairs into int16 *with saturation*, so neither the codes nor the query can simply be
 * shifted by 128 as on VNNI: (k + 128) c pairs reach 2 * 255 * 128 = 65,280 > 32,767. Instead
 * the sign moves from the code row to the query (VPABSB / VPSIGNB):
 *     c k = |c| (sgn(c) k),   |c| in 0..128 (unsigned: -128 gives 128), |sgn(c) k| = |k| <= 127,
 * so each product is at most 128 * 127 = 16,256 in magnitude and a pair at most 32,512: no
 * int16 sum saturates, and VPMADDWD with ones adds the pairs into exact int32 -- the integers
 * TDPBSSD gives, with no correction term. It needs the query codes in -127..127 (pack_query
 * refuses -128: VPSIGNB would negate it to itself). A block of 4 rows (contiguous codes) is
 * multiplied by 16 query columns at a time: 8 int32 accumulators in registers, two query vectors
 * per 4-byte group shared by the 4 rows, each row's 4-byte group broadcast from the mapped codes
 * (|c| once per broadcast, the sign once per product). The block PF blocks ahead is prefetched
 * at the block's start. The int32 go to a small buffer and are combined, scaled and folded into
 * per-document maxima in the same float32 order as the other two kernels (bitwise equal maxima).
 *   qpack  int8 [n_cg][n_codes][n_g][16][4]: per group of 16 query columns, level and 4-byte
 *          group of components, the 16 columns' 4 codes (-127..127; 0 for padding)
 *   out    float32 [n_docs][16 * n_cg]                                                       */
#define ATARGET __attribute__((target("avx2,fma")))
#define AR 4  /* rows per block: 8 accumulators, 2 query vectors, the broadcast and |c| in 16 ymm */
#define AROWS(X) X(0) X(1) X(2) X(3)

ATARGET static inline __m256i bcast8(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* acc += the int32 sums of four signed products per lane of the query vector q and the
 * broadcast codes b (|b| given as u): VPSIGNB, VPMADDUBSW, VPMADDWD with ones, VPADDD, in place
 * (GCC 12 compiles the intrinsics with a spilled accumulator and register copies: 1.9x slower) */
#define AMAC(acc, u, q, b) do { \
        __m256i t_; \
        __asm__("vpsignb %4, %3, %1\n\t" \
                "vpmaddubsw %1, %2, %1\n\t" \
                "vpmaddwd %5, %1, %1\n\t" \
                "vpaddd %1, %0, %0" \
                : "+x"(acc), "=&x"(t_) \
                : "x"(u), "x"(q), "x"(b), "x"(ones16)); \
    } while (0)

ATARGET int ep_avx2_docmax(const int8_t *codes, int64_t n_rows, int64_t dim, const float *scales,
                           const int64_t *starts, const int64_t *ends, int64_t n_docs,
                           const int8_t *qpack, int n_cg, int n_codes, int n_g, const float *w,
                           float *out) {
    if (n_codes < 1 || n_codes > 3 || n_cg < 1 || n_g < 1 || 4 * (int64_t)n_g < dim) return -1;
    const int mp = 16 * n_cg;
    const int64_t kpad = 4 * (int64_t)n_g;
    const size_t pad_bytes = ((size_t)AR * kpad + 64 + 31) & ~(size_t)31;
    /* the block's int32: [level][column group][row][16 columns] */
    int32_t *cbuf = aligned_alloc(32, (size_t)n_codes * n_cg * AR * 16 * sizeof(int32_t));
    float *dm = aligned_alloc(32, (size_t)mp * sizeof(float));
    int8_t *pad = aligned_alloc(32, pad_bytes);
    if (!cbuf || !dm || !pad) {
        free(cbuf); free(dm); free(pad);
        return -1;
    }
    for (int i = 0; i < mp; i++) dm[i] = -__builtin_inff();
    const int64_t total = n_rows * dim;
    const __m256i zero = _mm256_setzero_si256(), ones16 = _mm256_set1_epi16(1);
    const __m256 wv1 = _mm256_set1_ps(n_codes > 1 ? w[1] : 0.0f), wv2 = _mm256_set1_ps(n_codes > 2 ? w[2] : 0.0f);
    const int64_t level_stride = (int64_t)n_cg * AR * 16;
    __m256 scale[AR];

    for (int64_t d = 0, e; d < n_docs; d = e) {
        e = run_end(starts, ends, n_docs, d);
        const int64_t r0 = starts[d], r1 = ends[e - 1];
        int64_t cur = d;
        for (int64_t r = r0; r < r1; r += AR) {
            const int nr = (int)(r1 - r < AR ? r1 - r : AR);
            int64_t stride;
            const int8_t *a = block_codes(codes, dim, total, r, nr, AR, kpad, pad, pad_bytes, &stride);
            /* prefetching is a hint (past the last blocks it re-reads the first ones) */
            const int64_t ahead = (r + PF * AR) * dim;
            const char *pf = (const char *)(codes + (ahead + AR * dim <= total ? ahead : 0));
            for (int64_t o = 0; o < AR * dim; o += 64) _mm_prefetch(pf + o, _MM_HINT_T0);
            for (int t = 0; t < AR; t++) scale[t] = _mm256_set1_ps(scales && t < nr ? scales[r + t] : 1.0f);
            for (int cg = 0; cg < n_cg; cg++) {
                for (int l = 0; l < n_codes; l++) {
                    const int8_t *q = qpack + ((int64_t)cg * n_codes + l) * n_g * 64;
#define DECL(T) __m256i a##T##0 = zero, a##T##1 = zero;
                    AROWS(DECL)
#undef DECL
                    const int8_t *p = a;
                    for (int g = 0; g < n_g; g++, q += 64, p += 4) {
                        const __m256i q0 = _mm256_loadu_si256((const __m256i *)q);
                        const __m256i q1 = _mm256_loadu_si256((const __m256i *)(q + 32));
                        __m256i b, u;
#define STEP(T) b = bcast8(p + T * stride); u = _mm256_abs_epi8(b); AMAC(a##T##0, u, q0, b); AMAC(a##T##1, u, q1, b);
                        AROWS(STEP)
#undef STEP
                    }
                    int32_t *c = cbuf + l * level_stride + cg * AR * 16;
#define KEEP(T) _mm256_store_si256((__m256i *)(c + 16 * T), a##T##0); _mm256_store_si256((__m256i *)(c + 16 * T + 8), a##T##1);
                    AROWS(KEEP)
#undef KEEP
                }
            }
            /* the block's rows, one document's segment at a time, folded into its maxima */
            for (int i = 0, j; i < nr; i = j) {
                j = segment(ends, r, nr, i, &cur, out, dm, mp);
                for (int o = 0; o < mp; o += 8) { /* o: column; its block offset (o / 16) * AR * 16 + o % 16 */
                    const int32_t *c = cbuf + (o / 16) * AR * 16 + o % 16;
                    __m256 acc = _mm256_loadu_ps(dm + o);
                    for (int t = i; t < j; t++) {
                        __m256 v = _mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(c + 16 * t)));
                        if (n_codes > 1) v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(c + level_stride + 16 * t))), wv1, v);
                        if (n_codes > 2) v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_load_si256((const __m256i *)(c + 2 * level_stride + 16 * t))), wv2, v);
                        acc = _mm256_max_ps(acc, _mm256_mul_ps(v, scale[t]));
                    }
                    _mm256_storeu_ps(dm + o, acc);
                }
            }
        }
        for (; cur < e; cur++) flush_doc(out + cur * mp, dm, mp);
    }
    free(cbuf); free(dm); free(pad);
    return 0;
}
#else
int ep_amx_request(void) { return -1; }
#endif

/* The empty module (see above). */
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_amxscan", NULL, -1, NULL};

PyMODINIT_FUNC PyInit__amxscan(void) { return PyModule_Create(&module); }
