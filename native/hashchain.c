/*
 * cpd._hashchain: the chained block hashes of cpd.hashing in one native call.
 *
 *     h_i = BLAKE3_keyed(key, tokens of block i || h_{i-1})[:16]
 *
 * The result is byte-identical to the pure-Python loop in cpd.hashing (tests compare
 * them). Why native: in Python each block costs one keyed BLAKE3 call plus its overhead
 * (~2 us per 1 KiB block), which made hashing ~80 % of the router's CPU per decision.
 *
 * Why the tokens come before the parent hash: with 256-token blocks of uint32 ids a
 * block's tokens are exactly one BLAKE3 chunk (1 KiB), and that chunk's chaining value
 * does not depend on the parent. So the chunk values of many blocks are computed
 * together with BLAKE3's SIMD `hash_many` (8 or 16 lanes), and the sequential part of
 * the chain shrinks to two 64-byte compressions per block: the 16-byte parent chunk and
 * the root node that joins the two chunks. Other block sizes go through the ordinary
 * incremental hasher, one block at a time (blocks larger than a chunk still get SIMD
 * inside the block).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "blake3.h"
#include "blake3_impl.h"

#define HASH_BYTES 16
/* Blocks whose chunk values are computed in one hash_many call (bounded stack use). */
#define BATCH 64
/* Inputs at least this large are hashed with the GIL released. */
#define RELEASE_GIL_BYTES (64 * 1024)

/* One chunk per block: hash_many over the blocks' token chunks, then the chain. */
static void chain_chunk_blocks(const uint8_t key_bytes[BLAKE3_KEY_LEN],
                               const uint8_t *data, size_t n,
                               const uint8_t parent[HASH_BYTES], uint8_t *out) {
  uint32_t key[8];
  load_key_words(key_bytes, key);
  uint8_t cvs[BATCH * BLAKE3_OUT_LEN];
  const uint8_t *inputs[BATCH];
  const uint8_t *prev = parent;
  for (size_t base = 0; base < n; base += BATCH) {
    size_t m = n - base < BATCH ? n - base : BATCH;
    for (size_t j = 0; j < m; j++) {
      inputs[j] = data + (base + j) * BLAKE3_CHUNK_LEN;
    }
    /* Every block's token chunk is chunk 0 of its own message: counter 0 for all. */
    blake3_hash_many(inputs, m, BLAKE3_CHUNK_LEN / BLAKE3_BLOCK_LEN, key, 0, false,
                     KEYED_HASH, CHUNK_START, CHUNK_END, cvs);
    for (size_t j = 0; j < m; j++) {
      /* Chunk 1 of the message: the parent hash alone. */
      uint32_t tail_cv[8];
      memcpy(tail_cv, key, sizeof tail_cv);
      uint8_t tail[BLAKE3_BLOCK_LEN] = {0};
      memcpy(tail, prev, HASH_BYTES);
      blake3_compress_in_place(tail_cv, tail, HASH_BYTES, 1,
                               KEYED_HASH | CHUNK_START | CHUNK_END);
      /* The root: a parent node over the two chunks' chaining values. */
      uint8_t node[BLAKE3_BLOCK_LEN];
      memcpy(node, cvs + j * BLAKE3_OUT_LEN, BLAKE3_OUT_LEN);
      store_cv_words(node + BLAKE3_OUT_LEN, tail_cv);
      uint8_t root[BLAKE3_BLOCK_LEN];
      blake3_compress_xof(key, node, BLAKE3_BLOCK_LEN, 0, KEYED_HASH | PARENT | ROOT, root);
      uint8_t *h = out + (base + j) * HASH_BYTES;
      memcpy(h, root, HASH_BYTES);
      prev = h;
    }
  }
}

/* Any block size: the incremental hasher, one block at a time. */
static void chain_any_blocks(const uint8_t key[BLAKE3_KEY_LEN], const uint8_t *data,
                             size_t n, size_t block_bytes,
                             const uint8_t parent[HASH_BYTES], uint8_t *out) {
  blake3_hasher keyed;
  blake3_hasher_init_keyed(&keyed, key);
  const uint8_t *prev = parent;
  for (size_t i = 0; i < n; i++) {
    blake3_hasher h = keyed;
    blake3_hasher_update(&h, data + i * block_bytes, block_bytes);
    blake3_hasher_update(&h, prev, HASH_BYTES);
    uint8_t *dst = out + i * HASH_BYTES;
    blake3_hasher_finalize(&h, dst, HASH_BYTES);
    prev = dst;
  }
}

PyDoc_STRVAR(chain_doc,
"chain(key, data, block_bytes, parent) -> bytes\n\n"
"Chained keyed BLAKE3 hashes (16 bytes each, concatenated) of every full block of\n"
"``block_bytes`` bytes in ``data``: h_i = BLAKE3(key, block_i || h_{i-1})[:16], with\n"
"h_{-1} = ``parent``. A trailing partial block is ignored.");

static PyObject *chain(PyObject *self, PyObject *args) {
  Py_buffer key, data, parent;
  Py_ssize_t block_bytes;
  if (!PyArg_ParseTuple(args, "y*y*ny*", &key, &data, &block_bytes, &parent)) {
    return NULL;
  }
  PyObject *result = NULL;
  if (key.len != BLAKE3_KEY_LEN) {
    PyErr_Format(PyExc_ValueError, "key must be %d bytes", BLAKE3_KEY_LEN);
  } else if (parent.len != HASH_BYTES) {
    PyErr_Format(PyExc_ValueError, "parent must be %d bytes", HASH_BYTES);
  } else if (block_bytes <= 0) {
    PyErr_SetString(PyExc_ValueError, "block_bytes must be positive");
  } else {
    size_t n = (size_t)(data.len / block_bytes);
    result = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n * HASH_BYTES));
    if (result != NULL && n > 0) {
      uint8_t *out = (uint8_t *)PyBytes_AS_STRING(result);
      /* Small inputs keep the GIL: releasing and retaking it costs more than they do. */
      int release = data.len >= RELEASE_GIL_BYTES;
      PyThreadState *ts = release ? PyEval_SaveThread() : NULL;
      if (block_bytes == BLAKE3_CHUNK_LEN) {
        chain_chunk_blocks(key.buf, data.buf, n, parent.buf, out);
      } else {
        chain_any_blocks(key.buf, data.buf, n, (size_t)block_bytes, parent.buf, out);
      }
      if (release) {
        PyEval_RestoreThread(ts);
      }
    }
  }
  PyBuffer_Release(&key);
  PyBuffer_Release(&data);
  PyBuffer_Release(&parent);
  return result;
}

static PyObject *simd_degree(PyObject *self, PyObject *unused) {
  return PyLong_FromSize_t(blake3_simd_degree());
}

static PyMethodDef methods[] = {
    {"chain", chain, METH_VARARGS, chain_doc},
    {"simd_degree", simd_degree, METH_NOARGS,
     "How many chunks BLAKE3's hash_many processes at once on this CPU."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_hashchain",
    "Chained keyed BLAKE3 block hashes (see cpd.hashing).", -1, methods,
};

PyMODINIT_FUNC PyInit__hashchain(void) { return PyModule_Create(&module); }
