/* Batched chunk-file I/O for host page memory, with the GIL released for the whole batch.
 *
 * Built by `pip install` as gdskv.io._batchio (an optional extension: where no compiler is
 * present the pure-Python path in gdskv.io.posix does the same work). Called through
 * gdskv.io.batch by gdskv.io.posix.PosixEngine.read_chunks_now / write_chunks_now, which
 * gdskv.transfer's threads call once per slice of a step's pages, so a page costs a few system
 * calls and no Python.
 *
 * Every path is resolved by the kernel beneath the store's root descriptor without following a
 * link (openat2 RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS), and only regular
 * files are read, exactly as gdskv.confined does. A job that fails here reports its errno and
 * touches nothing else; the caller redoes it on the Python path, which sorts the failure out
 * (missing, refused, corrupt, disk full) with its counters and log lines.
 *
 * read_chunks(root_fd, jobs, crc_fn, direct, threads) -> list[(err, crc, verified, copied)]
 *   jobs: [(relpath: bytes, pieces: [(address, length), ...][, outs[, expect[, outs_cold]]]), ...]; the
 *   pieces lie end to end in the file from offset 0 and the last one is the chunk's trailer.
 *   err 0: every byte read, crc = CRC32C of all pieces but the last (crc_fn: the address
 *   gdskv.format.crc32c_address gives, gdskv._crc32c's kernel or google-crc32c's
 *   crc32c_extend). outs (optional, None, or the payload's length in all): where the payload
 *   is copied too once read (the host tier's buffer for the page); with outs_cold true, only
 *   when the chunk is not mostly in the page cache (copied 1 when it was copied). expect (optional):
 *   what the trailer must say (see trailer_ok); verified 1 when it does, so the caller's Python
 *   checks only the chunks that fail here. The payload is walked once, in cache-sized steps,
 *   each checksummed and then copied (out of staging, into outs) while in cache; a chunk mostly
 *   in the page cache (cached()) is read a step at a time, each step checksummed and copied
 *   while the kernel's copy of it is in cache. On success the file's mtime is refreshed
 *   (eviction ranks by recency) and its atime left alone (a lookup's lease).
 *   direct: read chunks mostly not in the page cache with O_DIRECT, aligned pieces in place and
 *   the rest through an aligned staging buffer. "Aligned": whole 4 KiB blocks at an address the
 *   file system's direct I/O takes (statx's STATX_DIOALIGN: on NVMe any 4-byte-aligned address,
 *   so torch's own CPU tensors, 64 bytes past a page boundary, are read in place; 512 on
 *   virtio disks; a page boundary where the kernel does not say).
 * write_chunks(root_fd, jobs, crc_fn, file_mode, chmod, sync, direct, threads, ..., dir_mode,
 *   dir_chmod) -> list[err]
 *   jobs: [(dir: bytes, tmp: bytes, name: bytes, pieces[, seal[, outs[, present]]]), ...]; writes the pieces
 *   end to end into dir/tmp (created exclusively), optionally fsyncs it, and renames it to
 *   dir/name. A job with seal true is sealed first (seal(), or stage_sealed in the pass that
 *   stages it): its last piece, a trailer packed with a zero payload checksum, gets the payload's
 *   CRC32C and its own, so no Python reads the page. outs (optional, None, or the payload's
 *   length in all): where the payload is copied too, in that same pass (the host tier's buffer
 *   for a page saved through it); a job that then fails leaves them filled but unused. present
 *   (optional, 0: none): the size of a stored chunk; where dir/name is a regular file of that size
 *   (not a link) the job writes nothing and ends in ERR_PRESENT, so the serving loop that posts a
 *   save need not look first. A missing dir is made first, with its parents (dir_mode,
 *   or -1: ENOENT instead), so the first saves into a new store take this path too.
 *   direct: the file's whole 4 KiB blocks go out with O_DIRECT (from the pieces where they are
 *   aligned, as reads judge it, else from an aligned staging copy) and, once that write
 *   returned, the rest (the payload's last partial block and the trailer) through the page
 *   cache; the file is preallocated first so both land in one extent.
 * threads: jobs of one call run on that many threads of its own (at most 64), each with its own
 *   staging buffer, so one call keeps several requests in flight without Python.
 * stat_chunks(root_fd, base, skeys, hi_bits, lo_bits, size) / lease_chunks(..., atime_ns, mtime_ns,
 *   check, size): a lookup's presence checks and leases (gdskv.store.Namespace.contains_many /
 *   lease_many), one call per lookup, named by the chunks' store keys (one bytes object) beneath
 *   their array directory, which is resolved once; each chunk's directory beneath it without
 *   following a link; a long lookup runs on up to PATH_THREADS threads (one per
 *   PATHS_PER_THREAD keys). chunk_mtimes(root_fd, base, skeys, hi_bits, lo_bits, size) finds
 *   them the same way and gives each one's mtime (the budget journals a step's published chunks
 *   with it: gdskv.eviction.Budget.on_published_many).
 * copy_many(copies, threads): host-memory copies [(dst, src, length), ...] in 1 MiB pieces on
 *   that many threads, the GIL released (host-tier hits into plain host memory).
 * dio_alignment(fd) -> (memory, offset, in_place) | None: what statx says O_DIRECT asks of
 *   buffers and offsets for the regular file `fd` ((0, 0, ...): no direct I/O there; None: the
 *   kernel does not say), and the memory alignment at which read_chunks and write_chunks move a
 *   page in place there (in_place_mem: the same rule, not a copy of it; gdskv info and gdskv
 *   bench report it).
 * copy_device(copies, memcpy_async, stream) -> int: each copy [(dst, src, length), ...] queued in
 *   order on a CUDA stream by the CUDA runtime's cudaMemcpyAsync (its address: memcpy_async, found
 *   by gdskv.io.capabilities; cudaMemcpyDefault, so host to device and back alike), the GIL
 *   released for all of them: 0, or the first error (the copies after it not queued). A staged
 *   slice's copies cost one call, where one torch copy each cost two hand-offs of the GIL between
 *   the transfer threads (gdskv.hosttier).
 * Completions(): reads and writes that finish without anyone waiting (saves, and asynchronous
 *   loads, which no forward pass waits for). q.read_later(root_fd, jobs, crc_fn, direct, threads, staging, staging_len,
 *   nice, tag) starts read_chunks' work on threads of its own (their nice value raised by
 *   `nice`) and returns at once; q.collect() hands back [(tag, [(err, crc, verified, copied), ...]), ...]
 *   for every call finished since, without waiting. The serving loop collects between its
 *   steps, so no Python thread needs the interpreter while pages move: a Python thread woken by
 *   every completion took the GIL from the serving thread at each one (and, niced, made it wait
 *   for a CPU). q.wait_overdue(grace, timeout) blocks, GIL released, until a finished call has
 *   gone uncollected for `grace` seconds (True; its caller collects instead), or `timeout`
 *   passes or q.close() is called (False); q.wait_idle(timeout): until no call is running.
 *   q.write_later(root_fd, jobs, crc_fn, file_mode, chmod, sync, direct, threads, staging,
 *   staging_len, dir_mode, dir_chmod, nice, tag) does the same for write_chunks (an errno per
 *   job in collect). q.copy_later(copies, threads, nice, tag) does the same for copy_many
 *   (None for results in collect). q.hurry(+1/-1) counts callers blocked on a result: while any
 *   is, wait_overdue does not wait out the grace.
 * staging, staging_len (the two arguments after threads, in both): the caller's aligned memory
 *   for those buffers, `staging_need(jobs, threads)` bytes. Huge-page memory matters: an
 *   O_DIRECT request into 4 KiB pages is cut at the queue's segment limit (254 pages on the
 *   disks measured), one into huge pages is not. Where it is too small (or 0), each thread
 *   allocates its own.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>
#endif

#define ALIGN 4096
#define MAX_PIECES 64
#define MAX_THREADS 64
#define ERR_SHORT (-1)   /* the file ended before every byte was read */
#define ERR_NOT_REGULAR (-2)
#define ERR_PRESENT (-3)  /* write: the chunk was stored already (the job's `present` size), nothing written */
#define STEP (64 * 1024)  /* bytes checksummed, then copied, while they are in the core's cache */
#define READ_STEP (256 * 1024)  /* bytes read through the page cache, then checksummed and copied */
#define TRAILER_BYTES 128
#define EXPECT_MAX (8 + 32 + 32)  /* group u32, payload length u32, store key, block key (8 or 32) */
#ifndef SYS_cachestat
#define SYS_cachestat 451
#endif

typedef uint32_t (*crc_fn_t)(uint32_t, const void *, size_t);

typedef struct {
    char *path;       /* read: path from the root; write: the directory */
    char *tmp;
    char *name;
    int npieces;
    struct iovec pieces[MAX_PIECES];
    int nouts;        /* read: copy-out pieces of the payload, or 0 */
    struct iovec outs[MAX_PIECES];
    int err;
    uint32_t crc;
    int expect_len;   /* read: 0, or the bytes of expect (what the trailer must say) */
    unsigned char expect[EXPECT_MAX];
    int verified;     /* read: the trailer says exactly what expect asks, and the payload's CRC */
    int outs_cold;    /* read: copy into outs only when the chunk is not served by the page cache */
    int copied;       /* read: the payload was copied into outs */
    int seal;         /* write: the last piece is a trailer whose checksums are filled in here (seal()) */
    long long present; /* write: 0, or the size of a stored chunk: a regular file of it at name is left as it is */
} job_t;

struct cachestat_range { uint64_t off, len; };
struct cachestat { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; };

static int open_beneath(int root, const char *path, uint64_t flags, uint64_t mode) {
    struct open_how how;
    memset(&how, 0, sizeof how);
    how.flags = flags | O_CLOEXEC | O_NOFOLLOW;
    how.mode = (flags & O_CREAT) ? mode : 0;
    how.resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS;
    return (int)syscall(SYS_openat2, root, path, &how, sizeof how);
}

static size_t total_len(const struct iovec *iov, int n) {
    size_t t = 0;
    for (int i = 0; i < n; i++) t += iov[i].iov_len;
    return t;
}

/* Every byte of the iovecs from `offset`, retrying partial transfers; the bytes moved. */
static ssize_t move_all(int fd, struct iovec *iov, int n, off_t offset, int write) {
    struct iovec local[MAX_PIECES + 1];
    memcpy(local, iov, sizeof(struct iovec) * n);
    struct iovec *cur = local;
    ssize_t done = 0;
    while (n > 0) {
        ssize_t got = write ? pwritev(fd, cur, n, offset + done) : preadv(fd, cur, n, offset + done);
        if (got < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (got == 0) break;
        done += got;
        while (n > 0 && (size_t)got >= cur->iov_len) {
            got -= cur->iov_len;
            cur++;
            n--;
        }
        if (n > 0 && got) {
            cur->iov_base = (char *)cur->iov_base + got;
            cur->iov_len -= got;
        }
    }
    return done;
}

/* Whether most of the file's first `len` bytes are in the page cache: at least half their pages.
 * A chunk with a page or two reclaimed (seen: its last, partial page, which holds the trailer)
 * is still read through the cache, the kernel fetching just those pages, not all of it from disk. */
static int cached(int fd, size_t len) {
    struct cachestat_range r = {0, len};
    struct cachestat cs;
    if (syscall(SYS_cachestat, fd, &r, &cs, 0) != 0) return 0;
    return cs.nr_cache * 2 >= (len + 4095) / 4096;
}

/* Whether O_DIRECT can move `v` in place: whole 4 KiB blocks at an address aligned to `mem`, the
 * file system's own direct-I/O memory alignment (file_dio_mem). */
static int aligned(const struct iovec *v, unsigned mem) {
    return ((uintptr_t)v->iov_base % mem) == 0 && v->iov_len % ALIGN == 0 && v->iov_len > 0;
}

/* statx(2)'s answer as the kernel lays it out (include/uapi/linux/stat.h), read by offset so the
 * build needs no headers newer than the C library's. */
typedef struct {
    uint32_t mask, blksize;
    uint64_t attributes;
    uint32_t nlink, uid, gid;
    uint16_t mode, spare0;
    unsigned char skip[152 - 32];  /* ino ... mnt_id */
    uint32_t dio_mem_align, dio_offset_align;
    unsigned char rest[256 - 160];
} kstatx_t;
#define KSTATX_TYPE 0x1U
#define KSTATX_DIOALIGN 0x2000U

/* The memory alignment at which O_DIRECT moves a page in place, from statx's answer: the one the
 * file system asks of O_DIRECT buffers (STATX_DIOALIGN, Linux 6.1+: 4 bytes on NVMe, 512 on the
 * virtio disks measured); ALIGN where the kernel does not say, or says something a chunk's 4 KiB
 * offsets could not meet: O_DIRECT then takes only page-aligned memory, as it always may. */
static unsigned in_place_mem(const kstatx_t *sx) {
    if ((sx->mask & KSTATX_DIOALIGN) && sx->dio_mem_align && sx->dio_mem_align <= ALIGN &&
        ALIGN % sx->dio_mem_align == 0 && sx->dio_offset_align && ALIGN % sx->dio_offset_align == 0)
        return sx->dio_mem_align;
    return ALIGN;
}

/* The file's mode and in `*mem` its in_place_mem, from one statx (fstat, and ALIGN, where a
 * seccomp filter or an old kernel refuses statx). 0, or an errno. */
static int file_dio_mem(int fd, mode_t *mode, unsigned *mem) {
    kstatx_t sx;
    *mem = ALIGN;
    if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, KSTATX_TYPE | KSTATX_DIOALIGN, &sx) != 0) {
        struct stat st;
        if (errno != ENOSYS && errno != EPERM) return errno;
        if (fstat(fd, &st) != 0) return errno;
        *mode = st.st_mode;
        return 0;
    }
    *mode = sx.mode;
    *mem = in_place_mem(&sx);
    return 0;
}

/* One O_DIRECT preadv of the chunk: the leading aligned payload pieces in place, the rest
 * (always the trailer) into `staging` (at least the rest rounded up to ALIGN). `*staged`: the
 * first piece that landed in staging; finish() copies those out. */
static int read_direct(int fd, job_t *j, char *staging, int *staged, unsigned mem) {
    struct iovec iov[MAX_PIECES + 1];
    int k = 0;
    while (k < j->npieces - 1 && aligned(&j->pieces[k], mem)) {
        iov[k] = j->pieces[k];
        k++;
    }
    size_t want = total_len(j->pieces, j->npieces);
    size_t rest = want - total_len(j->pieces, k);
    iov[k].iov_base = staging;
    iov[k].iov_len = (rest + ALIGN - 1) / ALIGN * ALIGN;
    ssize_t got = move_all(fd, iov, k + 1, 0, 0);
    if (got < 0) return errno;
    if ((size_t)got < want) return ERR_SHORT;
    *staged = k;
    return 0;
}

/* Where a job's copy-out pieces stand while its payload is walked. */
typedef struct {
    struct iovec *v;
    int n, i;
    size_t off;
} cursor_t;

/* memcpy with non-temporal stores for the whole 16-byte-aligned lines of `dst`: the copy-outs
 * fill the host tier's buffers, which nothing reads until a later load hits them, so they skip
 * the read-for-ownership of each destination line and leave the core's cache to the payload
 * being checksummed. Ordered by the sfence before return (the caller's results are published
 * after). Plain memcpy elsewhere than x86-64 and for short copies. */
static void copy_streaming(char *dst, const char *src, size_t len) {
#if defined(__x86_64__) && defined(__SSE2__)
    if (len >= 4096) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head;
        src += head;
        len -= head;
        for (; len >= 64; dst += 64, src += 64, len -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src), b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32)), d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        _mm_sfence();
    }
#endif
    memcpy(dst, src, len);
}

static void put_out(cursor_t *c, const char *src, size_t len) {
    while (len && c->i < c->n) {
        size_t room = c->v[c->i].iov_len - c->off;
        size_t take = len < room ? len : room;
        copy_streaming((char *)c->v[c->i].iov_base + c->off, src, take);
        src += take;
        len -= take;
        c->off += take;
        if (c->off == c->v[c->i].iov_len) {
            c->i++;
            c->off = 0;
        }
    }
}

/* After a whole read: the payload's CRC32C, walking it once in STEP-sized steps, each one
 * checksummed and then, while in cache, copied where it belongs: out of `staging` into its piece
 * (pieces from `staged` on were read there) and into the job's outs. The trailer is copied out
 * of staging too. */
static uint32_t finish(job_t *j, crc_fn_t crc, int staged, const char *staging) {
    cursor_t out = {j->outs, j->nouts, 0, 0};
    uint32_t c = 0;
    size_t spos = 0;
    for (int i = 0; i < j->npieces; i++) {
        char *dst = j->pieces[i].iov_base;
        size_t len = j->pieces[i].iov_len;
        const char *src = i >= staged ? staging + spos : dst;
        if (i >= staged) spos += len;
        if (i == j->npieces - 1) {
            if (src != dst) memcpy(dst, src, len);
            break;
        }
        for (size_t at = 0; at < len; at += STEP) {
            size_t n = len - at < STEP ? len - at : STEP;
            c = crc(c, src + at, n);
            if (src != dst) memcpy(dst + at, src + at, n);
            if (j->nouts) put_out(&out, src + at, n);
        }
    }
    return c;
}

/* A read through the page cache, a step at a time: each READ_STEP of payload is read into its
 * piece and, while the kernel's copy of it is still in the core's cache, checksummed and copied
 * into the job's outs; then the trailer. One pass over memory instead of a read and a second walk
 * (the payload of a 1 MiB page no longer fits the cache by the time that walk starts). */
static int read_buffered(int fd, job_t *j, crc_fn_t crc) {
    cursor_t out = {j->outs, j->nouts, 0, 0};
    uint32_t c = 0;
    off_t pos = 0;
    int last = j->npieces - 1;  /* the trailer: read with the payload's last step */
    int i = 0;
    size_t at = 0;              /* within piece i */
    do {
        struct iovec v[MAX_PIECES + 1];
        int n = 0;
        size_t room = READ_STEP;
        while (i < last && room) {
            size_t take = j->pieces[i].iov_len - at < room ? j->pieces[i].iov_len - at : room;
            v[n].iov_base = (char *)j->pieces[i].iov_base + at;
            v[n++].iov_len = take;
            room -= take;
            at += take;
            if (at == j->pieces[i].iov_len) {
                i++;
                at = 0;
            }
        }
        int payload = n;
        if (i == last) v[n++] = j->pieces[last];
        size_t want = total_len(v, n);
        ssize_t got = move_all(fd, v, n, pos, 0);
        if (got < 0) return errno;
        if ((size_t)got < want) return ERR_SHORT;
        pos += got;
        for (int k = 0; k < payload; k++) {
            c = crc(c, v[k].iov_base, v[k].iov_len);
            if (j->nouts) put_out(&out, v[k].iov_base, v[k].iov_len);
        }
    } while (i < last);
    j->crc = c;
    return 0;
}

static uint32_t le32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int all_zero(const unsigned char *p, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

/* Whether a read chunk's trailer is exactly what gdskv.checksum.check would accept for the job's
 * expect with no auth key: a version 2 trailer that checks itself, unauthenticated, CRC32C over
 * the payload equal to `payload_crc`, the expected group, payload length, store key and block key,
 * zero padding and no reserved flag. Anything else (version 1, another algorithm, a MAC, any
 * mismatch) is 0 and gdskv.transfer checks the chunk in Python, which says why it is refused. */
static int trailer_ok(const job_t *j, crc_fn_t crc, uint32_t payload_crc) {
    const struct iovec *tv = &j->pieces[j->npieces - 1];
    const unsigned char *t = tv->iov_base, *e = j->expect;
    if (tv->iov_len != TRAILER_BYTES || memcmp(t, "GDSKVPG1", 8) != 0 || t[8] != 2 || t[9] != 0) return 0;
    unsigned flags = (unsigned)t[10] | (unsigned)t[11] << 8;
    size_t key_len = flags >> 8;
    if ((flags & 0xF0) || ((flags >> 1) & 7) != 0 || key_len != (size_t)j->expect_len - 40) return 0;
    static const unsigned char zeros[4] = {0};
    uint32_t own = crc(crc(crc(0, t, 20), zeros, 4), t + 24, TRAILER_BYTES - 24);
    if (own != le32(t + 20) || le32(t + 12) != le32(e) || le32(t + 16) != le32(e + 4)) return 0;
    if (total_len(j->pieces, j->npieces - 1) != le32(e + 4)) return 0;
    if (le32(t + 24) != payload_crc || le32(t + 28) != 0) return 0;
    if (memcmp(t + 32, e + 8, 32) != 0 || memcmp(t + 64, e + 40, key_len) != 0) return 0;
    size_t parent_len = (flags & 1) ? key_len : 0;
    return all_zero(t + 64 + key_len, 32 - key_len) && all_zero(t + 96 + parent_len, 32 - parent_len);
}

static void read_one(int root, job_t *j, crc_fn_t crc, int direct, char *staging) {
    int fd = open_beneath(root, j->path, O_RDONLY | O_NONBLOCK, 0);
    if (fd < 0) {
        j->err = errno;
        return;
    }
    mode_t mode = 0;
    unsigned mem;
    int staged = j->npieces;
    j->err = file_dio_mem(fd, &mode, &mem);
    if (j->err == 0 && !S_ISREG(mode)) j->err = ERR_NOT_REGULAR;
    if (j->err == 0) {
        size_t want = total_len(j->pieces, j->npieces);
        /* the head only: cachestat walks every folio of its range, a thousand for a 4 MiB chunk
         * read into the cache by readahead (4 KiB folios), 5-7% of a warm load's time; chunks are
         * written and read whole, so their head tells */
        int warm = cached(fd, want < READ_STEP ? want : READ_STEP);
        if (warm && j->outs_cold) j->nouts = 0;
        if (warm) {
            j->err = read_buffered(fd, j, crc);
        } else {
            if (direct && staging && fcntl(fd, F_SETFL, O_DIRECT) == 0) {
                j->err = read_direct(fd, j, staging, &staged, mem);
            } else {  /* one request for the whole chunk: the kernel reads it ahead in one go */
                ssize_t got = move_all(fd, j->pieces, j->npieces, 0, 0);
                j->err = got < 0 ? errno : ((size_t)got < want ? ERR_SHORT : 0);
            }
            if (j->err == 0) j->crc = finish(j, crc, staged, staging);
        }
        if (j->err == 0) {
            if (j->expect_len) j->verified = trailer_ok(j, crc, j->crc);
            j->copied = j->nouts > 0;
            /* recency: the mtime; the atime is left alone, it may hold a lookup's lease */
            struct timespec now[2] = {{0, UTIME_OMIT}, {0, UTIME_NOW}};
            futimens(fd, now);
        }
    }
    close(fd);
}

/* Whether the pieces before `cut` are aligned and end exactly at it: the leading whole blocks of
 * a chunk can then be written with O_DIRECT from the pieces themselves (in `iov`, `*n` of them). */
static int head_in_place(job_t *j, size_t cut, struct iovec *iov, int *n, unsigned mem) {
    int k = 0;
    size_t covered = 0;
    while (k < j->npieces && covered < cut && aligned(&j->pieces[k], mem) && covered + j->pieces[k].iov_len <= cut) {
        iov[k] = j->pieces[k];
        covered += j->pieces[k].iov_len;
        k++;
    }
    *n = k;
    return covered == cut;
}

/* The leading whole blocks of a chunk, written with O_DIRECT on `fd` (O_DIRECT is set for the
 * call and cleared after): from the pieces themselves when every piece before the cut is
 * aligned (to `mem`), else from `staging` (at least `cut` bytes, aligned), copied there now
 * unless `staged` (stage_sealed did). 0, or an errno. */
static int write_head_direct(int fd, job_t *j, size_t cut, char *staging, int staged, unsigned mem) {
    struct iovec iov[MAX_PIECES];
    int n;
    if (staged || !head_in_place(j, cut, iov, &n, mem)) {
        size_t pos = 0;
        for (int i = 0; !staged && i < j->npieces && pos < cut; i++) {
            size_t take = j->pieces[i].iov_len;
            if (take > cut - pos) take = cut - pos;
            memcpy(staging + pos, j->pieces[i].iov_base, take);
            pos += take;
        }
        iov[0].iov_base = staging;
        iov[0].iov_len = cut;
        n = 1;
    }
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0 || fcntl(fd, F_SETFL, flags | O_DIRECT) != 0) return EINVAL;
    ssize_t put = move_all(fd, iov, n, 0, 1);
    int err = put < 0 ? errno : ((size_t)put != cut ? EIO : 0);
    if (fcntl(fd, F_SETFL, flags) != 0 && !err) err = errno;
    return err;
}

/* The pieces from byte `from` of the chunk to its end, through the page cache. */
static int write_rest(int fd, job_t *j, size_t from) {
    struct iovec iov[MAX_PIECES];
    int n = 0;
    size_t pos = 0, want = 0;
    for (int i = 0; i < j->npieces; i++) {
        size_t len = j->pieces[i].iov_len;
        if (pos + len > from) {
            size_t skip = from > pos ? from - pos : 0;
            iov[n].iov_base = (char *)j->pieces[i].iov_base + skip;
            iov[n].iov_len = len - skip;
            want += len - skip;
            n++;
        }
        pos += len;
    }
    if (!n) return 0;
    ssize_t put = move_all(fd, iov, n, (off_t)from, 1);
    return put < 0 ? errno : ((size_t)put != want ? EIO : 0);
}

/* The directory `rel` beneath the root and its missing parents, made with `mode` (exactly, when
 * `do_chmod`), each opened beneath the root without following a link, as
 * gdskv.confined.ConfinedDir.makedirs does: the deepest existing ancestor is found going up, and
 * the missing components are made going down from its descriptor, one at a time (a chunk's two
 * new directories cost 8 system calls, not 19 as from the root each time). Threads making the
 * same one race harmlessly (EEXIST). Returns 0 with `*out` the directory opened (O_PATH), or an
 * errno. */
static int make_dirs(int root, const char *rel, int mode, int do_chmod, int *out) {
    char path[4096];
    size_t len = strlen(rel);
    if (len >= sizeof path) return ENAMETOOLONG;
    if (len == 0 || rel[0] == '/' || rel[len - 1] == '/' || strstr(rel, "//")) return EINVAL;
    memcpy(path, rel, len + 1);
    size_t have = len;  /* path[0:have] is the part that exists (0: the root itself) */
    int fd = -1;
    for (;;) {
        char *slash = have ? memrchr(path, '/', have) : NULL;
        have = slash ? (size_t)(slash - path) : 0;
        if (have) {
            path[have] = 0;
            fd = open_beneath(root, path, O_PATH | O_DIRECTORY, 0);
            path[have] = '/';
        } else {
            fd = open_beneath(root, ".", O_PATH | O_DIRECTORY, 0);
        }
        if (fd >= 0) break;
        if (errno != ENOENT || !have) return errno;
    }
    const char *name = have ? path + have + 1 : path;
    for (;;) {
        char *slash = strchr(name, '/');
        if (slash) *slash = 0;
        int err = 0;
        if (mkdirat(fd, name, (mode_t)mode) == 0) {
            if (do_chmod) {
                int cfd = openat(fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
                if (cfd < 0 || fchmod(cfd, (mode_t)mode) != 0) err = errno;
                if (cfd >= 0) close(cfd);
            }
        } else if (errno != EEXIST) {
            err = errno;
        }
        int next = err ? -1 : open_beneath(fd, name, O_PATH | O_DIRECTORY, 0);
        if (!err && next < 0) err = errno;
        close(fd);
        if (err) return err;
        fd = next;
        if (!slash) break;
        name = slash + 1;
    }
    *out = fd;
    return 0;
}

static void put_le(unsigned char *p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) p[i] = (unsigned char)(v >> (8 * i));
}

/* A version 2 CRC32C trailer completed for a payload whose CRC32C is `payload` (gdskv.format.pack):
 * that CRC at byte 24 (zero-extended to 64 bits), then the trailer's own CRC32C, taken with that
 * field zero, at byte 20. The caller packed the rest (keys, lengths, flags). */
static void seal_trailer(job_t *j, uint32_t payload, crc_fn_t crc) {
    unsigned char *t = j->pieces[j->npieces - 1].iov_base;
    put_le(t + 24, payload, 8);
    put_le(t + 20, 0, 4);
    put_le(t + 20, crc(0, t, TRAILER_BYTES), 4);
}

/* A save's one pass over its payload before the write, a STEP at a time while in cache: copied
 * into `staging` below `cut` (the pieces are not aligned; 0: nothing staged), checksummed when
 * `sum`, and copied into the job's outs (the host tier's buffer for the page, which a save fills
 * as it writes through). One read of the page, not one per purpose. The payload's CRC32C, or 0. */
static uint32_t payload_pass(job_t *j, crc_fn_t crc, int sum, size_t cut, char *staging) {
    cursor_t out = {j->outs, j->nouts, 0, 0};
    uint32_t c = 0;
    size_t pos = 0;
    for (int k = 0; k < j->npieces - 1; k++) {
        const char *src = j->pieces[k].iov_base;
        size_t len = j->pieces[k].iov_len;
        for (size_t at = 0; at < len;) {
            size_t n = len - at < STEP ? len - at : STEP;
            const char *from = src + at;
            if (pos < cut) {
                if (n > cut - pos) n = cut - pos;
                memcpy(staging + pos, from, n);
                from = staging + pos;
            }
            if (sum) c = crc(c, from, n);
            if (j->nouts) put_out(&out, from, n);
            at += n;
            pos += n;
        }
    }
    return c;
}

static void seal(job_t *j, crc_fn_t crc) {
    seal_trailer(j, payload_pass(j, crc, 1, 0, NULL), crc);
}

/* A save whose leading `cut` bytes go to the disk through `staging` (its pieces are not aligned),
 * sealed in the pass that stages it (payload_pass), then the trailer's bytes below the cut staged
 * too. */
static void stage_sealed(job_t *j, size_t cut, char *staging, crc_fn_t crc) {
    size_t payload = total_len(j->pieces, j->npieces - 1);
    seal_trailer(j, payload_pass(j, crc, 1, cut, staging), crc);
    if (payload < cut) memcpy(staging + payload, j->pieces[j->npieces - 1].iov_base, cut - payload);
}

/* Whether `name` in `dfd` is a stored chunk of `size` bytes: a regular file (not a link) of that
 * size; `st` gets what fstatat found. */
static int chunk_of_size(int dfd, const char *name, long long size, struct stat *st) {
    return fstatat(dfd, name, st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st->st_mode) && st->st_size == size;
}

/* `mem`: the store's direct-I/O memory alignment as this thread learnt it from the first file it
 * made (file_dio_mem), 0 until then. */
static void write_one(int root, job_t *j, int file_mode, int do_chmod, int do_sync, int direct, char *staging,
                      int dir_mode, int dir_chmod, crc_fn_t crc, unsigned *mem) {
    int dfd = open_beneath(root, j->path, O_PATH | O_DIRECTORY, 0);
    if (dfd < 0 && errno == ENOENT && dir_mode >= 0) {
        int err = make_dirs(root, j->path, dir_mode, dir_chmod, &dfd);
        if (err) {
            j->err = err;
            return;
        }
    }
    if (dfd < 0) {
        j->err = errno;
        return;
    }
    struct stat st;
    if (j->present && chunk_of_size(dfd, j->name, j->present, &st)) {
        j->err = ERR_PRESENT;
        close(dfd);
        return;
    }
    int fd = openat(dfd, j->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, file_mode);
    if (fd < 0) {
        j->err = errno;
        close(dfd);
        return;
    }
    int err = 0;
    size_t want = total_len(j->pieces, j->npieces);
    size_t cut = direct && staging ? want / ALIGN * ALIGN : 0;
    if (cut && !*mem) {
        mode_t mode;
        (void)file_dio_mem(fd, &mode, mem);  /* ALIGN when the kernel cannot say */
    }
    struct iovec head[MAX_PIECES];
    int nhead, staged = 0;
    if (j->seal && cut && !head_in_place(j, cut, head, &nhead, *mem)) {
        stage_sealed(j, cut, staging, crc);
        staged = 1;
    } else if (j->seal) {
        seal(j, crc);
    } else if (j->nouts) {
        payload_pass(j, crc, 0, 0, NULL);
    }
    if (do_chmod && fchmod(fd, file_mode) != 0) err = errno;
    if (!err && cut) {
        if (fallocate(fd, 0, 0, (off_t)want) != 0 && errno != EOPNOTSUPP) err = errno;
        if (!err) {
            err = write_head_direct(fd, j, cut, staging, staged, *mem);
            if (err == EINVAL) {  /* the file system refuses O_DIRECT here: all of it buffered */
                err = 0;
                cut = 0;
            }
        }
    }
    if (!err) err = write_rest(fd, j, cut);
    if (!err && do_sync && fsync(fd) != 0) err = errno;
    if (close(fd) != 0 && !err) err = errno;
    if (!err && renameat(dfd, j->tmp, dfd, j->name) != 0) err = errno;
    if (err) unlinkat(dfd, j->tmp, 0);
    close(dfd);
    j->err = err;
}

/* Jobs of one call spread over worker threads: each takes the next job until none is left. */
typedef struct {
    job_t *jobs;
    Py_ssize_t n;
    Py_ssize_t next;  /* taken with __atomic_fetch_add */
    int writes, root, direct, file_mode, do_chmod, do_sync;
    int dir_mode, dir_chmod;  /* writes: missing directories are made with dir_mode (-1: not made) */
    crc_fn_t crc;
    size_t staging_bytes;  /* per thread */
    char *ext;             /* the caller's staging memory (huge-page or pinned), or NULL */
    size_t ext_len;
    int next_slot;         /* taken with __atomic_fetch_add: which part of `ext` a thread uses */
} batch_t;

static void *run_batch(void *arg) {
    batch_t *b = arg;
    char *staging = NULL, *own = NULL;
    unsigned mem = 0;
    if (b->direct) {
        size_t slot = (size_t)__atomic_fetch_add(&b->next_slot, 1, __ATOMIC_RELAXED);
        if (b->ext && (slot + 1) * b->staging_bytes <= b->ext_len) staging = b->ext + slot * b->staging_bytes;
        else if (posix_memalign((void **)&own, ALIGN, b->staging_bytes) == 0) staging = own;
    }
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&b->next, 1, __ATOMIC_RELAXED);
        if (i >= b->n) break;
        if (b->writes) write_one(b->root, &b->jobs[i], b->file_mode, b->do_chmod, b->do_sync, b->direct, staging,
                                b->dir_mode, b->dir_chmod, b->crc, &mem);
        else read_one(b->root, &b->jobs[i], b->crc, b->direct, staging);
    }
    free(own);
    return NULL;
}

/* The staging bytes each thread of a call needs: its largest chunk, rounded up to whole blocks,
 * plus one block (a direct read of a chunk reads to the end of its last block). */
static size_t staging_for(size_t most) {
    return (most + 2 * ALIGN - 1) / ALIGN * ALIGN;
}

static size_t staging_per_thread(job_t *jobs, Py_ssize_t n) {
    size_t most = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        size_t t = total_len(jobs[i].pieces, jobs[i].npieces);
        if (t > most) most = t;
    }
    return staging_for(most);
}

/* How many threads a call of `n` jobs runs on when `threads` are asked for. */
static int threads_for(int threads, Py_ssize_t n) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > n) threads = (int)n;
    return threads < 1 ? 1 : threads;
}

/* fn(arg) on `threads` threads (this one included, at most MAX_THREADS), each taking work
 * from `arg` until none is left; called with the GIL released. */
static void run_on(void *(*fn)(void *), void *arg, int threads) {
    pthread_t tids[MAX_THREADS];
    int started = 0;
    for (int t = 1; t < threads && t < MAX_THREADS; t++) {
        if (pthread_create(&tids[started], NULL, fn, arg) != 0) break;  /* fewer threads, same work */
        started++;
    }
    fn(arg);
    for (int t = 0; t < started; t++) pthread_join(tids[t], NULL);
}

/* Runs the batch on `threads` threads (this one included); called with the GIL released. */
static void run_threads(batch_t *b, int threads) {
    b->staging_bytes = staging_per_thread(b->jobs, b->n);
    run_on(run_batch, b, threads_for(threads, b->n));
}

static char *copy_bytes(PyObject *b) {
    char *s;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(b, &s, &n) < 0) return NULL;
    if ((Py_ssize_t)strlen(s) != n) {
        PyErr_SetString(PyExc_ValueError, "path contains a NUL byte");
        return NULL;
    }
    char *out = malloc(n + 1);
    if (!out) {
        PyErr_NoMemory();
        return NULL;
    }
    memcpy(out, s, n + 1);
    return out;
}

static int parse_pieces(PyObject *seq, struct iovec *into, int *count) {
    PyObject *fast = PySequence_Fast(seq, "pieces must be a sequence");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n < 1 || n > MAX_PIECES) {
        Py_DECREF(fast);
        PyErr_SetString(PyExc_ValueError, "a chunk has 1 to 64 pieces");
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long addr, len;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "KK", &addr, &len)) {
            Py_DECREF(fast);
            return -1;
        }
        into[i].iov_base = (void *)(uintptr_t)addr;
        into[i].iov_len = (size_t)len;
    }
    *count = (int)n;
    Py_DECREF(fast);
    return 0;
}

/* A read job's copy-out pieces: exactly as many bytes as its payload (every piece but the last). */
static int parse_outs(PyObject *seq, job_t *j) {
    if (parse_pieces(seq, j->outs, &j->nouts) < 0) return -1;
    if (total_len(j->outs, j->nouts) != total_len(j->pieces, j->npieces - 1)) {
        PyErr_SetString(PyExc_ValueError, "copy-out pieces must add up to the payload");
        return -1;
    }
    return 0;
}

/* A read job's expect: group and payload length (u32, little-endian), store key, block key. */
static int parse_expect(PyObject *b, job_t *j) {
    char *s;
    Py_ssize_t n;
    if (PyBytes_AsStringAndSize(b, &s, &n) < 0) return -1;
    if (n != 40 + 8 && n != 40 + 32) {
        PyErr_SetString(PyExc_ValueError, "expect is 48 or 72 bytes");
        return -1;
    }
    memcpy(j->expect, s, n);
    j->expect_len = (int)n;
    return 0;
}

static void free_jobs(job_t *jobs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        free(jobs[i].path);
        free(jobs[i].tmp);
        free(jobs[i].name);
    }
    free(jobs);
}

static job_t *parse_jobs(PyObject *list, Py_ssize_t *count, int writes) {
    PyObject *fast = PySequence_Fast(list, "jobs must be a sequence");
    if (!fast) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    job_t *jobs = calloc(n ? n : 1, sizeof(job_t));
    if (!jobs) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *t = PySequence_Fast_GET_ITEM(fast, i);
        PyObject *path, *tmp = NULL, *name = NULL, *pieces, *outs = NULL, *expect = NULL;
        int ok = writes ? PyArg_ParseTuple(t, "SSSO|pOL", &path, &tmp, &name, &pieces, &jobs[i].seal, &outs,
                                           &jobs[i].present)
                        : PyArg_ParseTuple(t, "SO|OOp", &path, &pieces, &outs, &expect, &jobs[i].outs_cold);
        if (!ok || !(jobs[i].path = copy_bytes(path)) || (writes && (!(jobs[i].tmp = copy_bytes(tmp)) ||
            !(jobs[i].name = copy_bytes(name)))) || parse_pieces(pieces, jobs[i].pieces, &jobs[i].npieces) < 0 ||
            (outs && outs != Py_None && parse_outs(outs, &jobs[i]) < 0) ||
            (expect && expect != Py_None && parse_expect(expect, &jobs[i]) < 0)) {
            free_jobs(jobs, n);
            Py_DECREF(fast);
            return NULL;
        }
        if (jobs[i].seal && jobs[i].pieces[jobs[i].npieces - 1].iov_len != TRAILER_BYTES) {
            PyErr_SetString(PyExc_ValueError, "a job to seal must end in a trailer of TRAILER_BYTES");
            free_jobs(jobs, n);
            Py_DECREF(fast);
            return NULL;
        }
    }
    Py_DECREF(fast);
    *count = n;
    return jobs;
}

static PyObject *read_chunks(PyObject *self, PyObject *args) {
    int root, direct, threads;
    PyObject *list;
    unsigned long long crc_addr, ext_addr;
    Py_ssize_t ext_len;
    if (!PyArg_ParseTuple(args, "iOKpiKn", &root, &list, &crc_addr, &direct, &threads, &ext_addr, &ext_len)) return NULL;
    if (!crc_addr) {
        PyErr_SetString(PyExc_ValueError, "read_chunks needs crc32c_extend");
        return NULL;
    }
    Py_ssize_t n;
    job_t *jobs = parse_jobs(list, &n, 0);
    if (!jobs) return NULL;
    batch_t b = {jobs, n, 0, 0, root, direct, 0, 0, 0, -1, 0, (crc_fn_t)(uintptr_t)crc_addr, 0,
                 (char *)(uintptr_t)ext_addr, (size_t)ext_len, 0};
    Py_BEGIN_ALLOW_THREADS
    run_threads(&b, threads);
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        PyObject *r = Py_BuildValue("(iIii)", jobs[i].err, jobs[i].crc, jobs[i].verified, jobs[i].copied);
        if (!r) {
            Py_CLEAR(out);
            break;
        }
        PyList_SET_ITEM(out, i, r);
    }
    free_jobs(jobs, n);
    return out;
}

static PyObject *write_chunks(PyObject *self, PyObject *args) {
    int root, file_mode, do_chmod, do_sync, direct, threads, dir_mode, dir_chmod;
    PyObject *list;
    unsigned long long crc_addr, ext_addr;
    Py_ssize_t ext_len;
    if (!PyArg_ParseTuple(args, "iOKipppiKnip", &root, &list, &crc_addr, &file_mode, &do_chmod, &do_sync, &direct,
                          &threads, &ext_addr, &ext_len, &dir_mode, &dir_chmod)) return NULL;
    if (!crc_addr) {
        PyErr_SetString(PyExc_ValueError, "write_chunks needs crc32c_extend");
        return NULL;
    }
    Py_ssize_t n;
    job_t *jobs = parse_jobs(list, &n, 1);
    if (!jobs) return NULL;
    batch_t b = {jobs, n, 0, 1, root, direct, file_mode, do_chmod, do_sync, dir_mode, dir_chmod,
                 (crc_fn_t)(uintptr_t)crc_addr, 0, (char *)(uintptr_t)ext_addr, (size_t)ext_len, 0};
    Py_BEGIN_ALLOW_THREADS
    run_threads(&b, threads);
    Py_END_ALLOW_THREADS
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) PyList_SET_ITEM(out, i, PyLong_FromLong(jobs[i].err));
    free_jobs(jobs, n);
    return out;
}

/* A chunk's name beneath its array directory, from its 32-byte store key: what
 * gdskv.format.chunk_index and index_relpath make of it ("c/<hi>/0/<lo>", hi and lo the key's
 * leading hi_bits and next lo_bits, big-endian). */
#define NAME_MAX_LEN 48
static void chunk_name(const unsigned char *skey, int hi_bits, int lo_bits, char *out) {
    uint64_t lead = 0;
    for (int b = 0; b < 8; b++) lead = lead << 8 | skey[b];
    lead >>= 64 - hi_bits - lo_bits;
    uint64_t lo = lo_bits == 64 ? lead : lead & ((1ULL << lo_bits) - 1);
    uint64_t hi = lo_bits == 64 ? 0 : lead >> lo_bits;
    snprintf(out, NAME_MAX_LEN, "c/%llu/0/%llu", (unsigned long long)hi, (unsigned long long)lo);
}

/* The directory of `rel` opened beneath `root` (no links), and its last component in `*name`. */
static int open_parent(int root, char *rel, const char **name) {
    char *slash = strrchr(rel, '/');
    *slash = 0;
    int dfd = open_beneath(root, rel, O_PATH | O_DIRECTORY, 0);
    *slash = '/';
    *name = slash + 1;
    return dfd;
}

/* 1 yes, 0 no, -1 where openat2 itself is refused (old kernel, seccomp): the caller's own path
 * must answer then. */
static PyObject *answers(const signed char *ok, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) PyList_SET_ITEM(out, i, PyLong_FromLong(ok[i]));
    return out;
}

#define REFUSED_OPENAT2 (errno == ENOSYS || errno == EPERM)

/* Runs `fn` on each chunk's directory (opened beneath the array directory, no links) and last
 * component, with the GIL released; the answers as `answers` gives them. */
typedef signed char (*path_fn)(int dfd, const char *name, Py_ssize_t i, const void *ctx);

typedef struct {
    int base;
    char (*paths)[NAME_MAX_LEN];
    signed char *ok;
    Py_ssize_t n;
    Py_ssize_t next;
    path_fn fn;
    const void *ctx;
} paths_t;

static void *run_paths(void *arg) {
    paths_t *p = arg;
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED);
        if (i >= p->n) break;
        const char *name;
        int dfd = open_parent(p->base, p->paths[i], &name);
        if (dfd < 0) {
            p->ok[i] = REFUSED_OPENAT2 ? -1 : 0;
            continue;
        }
        p->ok[i] = p->fn(dfd, name, i, p->ctx);
        close(dfd);
    }
    return NULL;
}

/* Paths per extra thread of a lookup: below this a thread's start costs more than it saves. */
#define PATHS_PER_THREAD 128
#define PATH_THREADS 4

/* The chunk of each 32-byte store key in `skeys`, beneath the array directory `base` (relative
 * to `root`), through `fn`. The array directory is resolved once; a missing one holds nothing. */
static PyObject *each_key(int root, const char *base, Py_buffer *skeys, int hi_bits, int lo_bits, path_fn fn,
                          const void *ctx) {
    if (skeys->len % 32 || hi_bits < 0 || lo_bits < 1 || hi_bits + lo_bits > 64) {
        PyErr_SetString(PyExc_ValueError, "store keys must be 32 bytes each, and 0 < lo_bits, hi_bits + lo_bits <= 64");
        return NULL;
    }
    Py_ssize_t n = skeys->len / 32;
    char (*paths)[NAME_MAX_LEN] = malloc((n ? n : 1) * sizeof *paths);
    signed char *ok = calloc(n ? n : 1, 1);
    PyObject *out = NULL;
    if (!paths || !ok) {
        PyErr_NoMemory();
    } else {
        const unsigned char *keys = skeys->buf;
        Py_BEGIN_ALLOW_THREADS
        int dfd = open_beneath(root, base, O_PATH | O_DIRECTORY, 0);
        if (dfd < 0) {
            memset(ok, REFUSED_OPENAT2 ? -1 : 0, n ? n : 1);
        } else {
            for (Py_ssize_t i = 0; i < n; i++) chunk_name(keys + 32 * i, hi_bits, lo_bits, paths[i]);
            paths_t p = {dfd, paths, ok, n, 0, fn, ctx};
            int threads = (int)(n / PATHS_PER_THREAD);
            if (threads > PATH_THREADS) threads = PATH_THREADS;
            run_on(run_paths, &p, threads);
            close(dfd);
        }
        Py_END_ALLOW_THREADS
        out = answers(ok, n);
    }
    free(paths);
    free(ok);
    return out;
}

static signed char is_chunk(int dfd, const char *name, Py_ssize_t i, const void *ctx) {
    (void)i;
    struct stat st;
    return chunk_of_size(dfd, name, *(const long long *)ctx, &st);
}

/* stat_chunks(root_fd, base, skeys, hi_bits, lo_bits, size) -> [1/0/-1] (see `answers`): each
 * store key's chunk beneath the array directory `base` is a regular file (not a link) of `size`
 * bytes, resolved beneath the root without following a link. */
static PyObject *stat_chunks(PyObject *self, PyObject *args) {
    int root, hi_bits, lo_bits;
    const char *base;
    Py_buffer skeys;
    long long size;
    if (!PyArg_ParseTuple(args, "iyy*iiL", &root, &base, &skeys, &hi_bits, &lo_bits, &size)) return NULL;
    PyObject *out = each_key(root, base, &skeys, hi_bits, lo_bits, is_chunk, &size);
    PyBuffer_Release(&skeys);
    return out;
}

typedef struct { long long size; long long *mtimes; } times_t;

static signed char chunk_time(int dfd, const char *name, Py_ssize_t i, const void *ctx) {
    const times_t *t = ctx;
    struct stat st;
    if (!chunk_of_size(dfd, name, t->size, &st)) return 0;
    t->mtimes[i] = (long long)st.st_mtim.tv_sec * 1000000000LL + st.st_mtim.tv_nsec;
    return 1;
}

/* chunk_mtimes(root_fd, base, skeys, hi_bits, lo_bits, size) -> [mtime_ns | -1 | -2]: each store
 * key's chunk found as stat_chunks finds it, its mtime in nanoseconds where it is a regular file
 * of `size` bytes, -1 where it is not, -2 where openat2 is refused (see `answers`). */
static PyObject *chunk_mtimes(PyObject *self, PyObject *args) {
    int root, hi_bits, lo_bits;
    const char *base;
    Py_buffer skeys;
    times_t t;
    if (!PyArg_ParseTuple(args, "iyy*iiL", &root, &base, &skeys, &hi_bits, &lo_bits, &t.size)) return NULL;
    Py_ssize_t n = skeys.len / 32;
    t.mtimes = calloc(n ? n : 1, sizeof *t.mtimes);
    PyObject *ok = t.mtimes ? each_key(root, base, &skeys, hi_bits, lo_bits, chunk_time, &t) : PyErr_NoMemory();
    PyBuffer_Release(&skeys);
    PyObject *out = ok ? PyList_New(n) : NULL;
    for (Py_ssize_t i = 0; out && i < n; i++) {
        long v = PyLong_AsLong(PyList_GET_ITEM(ok, i));
        PyObject *item = PyLong_FromLongLong(v == 1 ? t.mtimes[i] : v == 0 ? -1 : -2);
        if (!item) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, item);
    }
    Py_XDECREF(ok);
    free(t.mtimes);
    return out;
}

typedef struct { long long atime, mtime, size; int check; } lease_t;

static signed char lease_one(int dfd, const char *name, Py_ssize_t i, const void *ctx) {
    const lease_t *l = ctx;
    long long a = l->atime + i, m = l->mtime + i;
    struct timespec ts[2] = {{a / 1000000000LL, a % 1000000000LL}, {m / 1000000000LL, m % 1000000000LL}};
    if (utimensat(dfd, name, ts, AT_SYMLINK_NOFOLLOW) != 0) return 0;
    if (!l->check && !l->size) return 1;
    struct stat st;
    if (fstatat(dfd, name, &st, AT_SYMLINK_NOFOLLOW) != 0) return 0;
    if (l->size && !(S_ISREG(st.st_mode) && st.st_size == l->size)) return 0;
    return !l->check || (long long)st.st_atim.tv_sec * 1000000000LL + st.st_atim.tv_nsec >= l->atime;
}

/* lease_chunks(root_fd, base, skeys, hi_bits, lo_bits, atime_ns, mtime_ns, check, size) ->
 * [1/0/-1]: sets the times of key i's chunk (as stat_chunks finds it) to (atime_ns + i,
 * mtime_ns + i) without following a link; 1 where that landed and, with `check`, the entry still
 * has an atime at or past `atime_ns` afterwards (an evictor renaming it aside in between takes
 * the name away: then it is not ours) and, with `size` > 0, it is a regular file of `size` bytes
 * (a lookup's presence check and lease in one pass). */
static PyObject *lease_chunks(PyObject *self, PyObject *args) {
    int root, hi_bits, lo_bits;
    const char *base;
    Py_buffer skeys;
    lease_t l;
    if (!PyArg_ParseTuple(args, "iyy*iiLLpL", &root, &base, &skeys, &hi_bits, &lo_bits, &l.atime, &l.mtime, &l.check,
                          &l.size))
        return NULL;
    PyObject *out = each_key(root, base, &skeys, hi_bits, lo_bits, lease_one, &l);
    PyBuffer_Release(&skeys);
    return out;
}

/* copy_many: host-memory copies (dst, src, len) spread over threads in COPY_PIECE-sized pieces.
 * A call moving at least STREAM_COPIES bytes in all (a prefix's worth of host-tier hits) writes
 * with non-temporal stores: far more than the cores' caches hold, so keeping the destination
 * lines there only costs a read-for-ownership of each (a hot load of 1 GiB of 256 KiB / 1 MiB
 * pages on the 2-vCPU VM: 11.0 -> 13.5 / 12.7 -> 16.8 GB/s). */
#define COPY_PIECE (1 << 20)
#define STREAM_COPIES (32u << 20)
typedef struct {
    char *dst;
    const char *src;
    size_t n;
} copy_t;

typedef struct {
    copy_t *items;
    Py_ssize_t n;
    Py_ssize_t next;  /* taken with __atomic_fetch_add */
    int stream;       /* copy_streaming rather than memcpy */
} copies_t;

static void *run_copies(void *arg) {
    copies_t *c = arg;
    for (;;) {
        Py_ssize_t i = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED);
        if (i >= c->n) break;
        if (c->stream) copy_streaming(c->items[i].dst, c->items[i].src, c->items[i].n);
        else memcpy(c->items[i].dst, c->items[i].src, c->items[i].n);
    }
    return NULL;
}

/* Parses [(dst, src, length), ...] into `c`'s pieces of at most `piece` bytes (c->items: the
 * caller frees them). 0, or -1 with the exception set. */
static int parse_copies(PyObject *list, copies_t *c, size_t piece) {
    PyObject *fast = PySequence_Fast(list, "copies must be a sequence");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), pieces = 0;
    unsigned long long total = 0;
    unsigned long long (*spec)[3] = calloc(n ? n : 1, sizeof *spec);
    if (!spec) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(fast, i), "KKK", &spec[i][0], &spec[i][1], &spec[i][2])) {
            free(spec);
            Py_DECREF(fast);
            return -1;
        }
        pieces += (Py_ssize_t)((spec[i][2] + piece - 1) / piece);
        total += spec[i][2];
    }
    Py_DECREF(fast);
    *c = (copies_t){calloc(pieces ? pieces : 1, sizeof(copy_t)), 0, 0, total >= STREAM_COPIES};
    if (!c->items) {
        free(spec);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        for (size_t at = 0; at < spec[i][2]; at += piece) {
            size_t len = spec[i][2] - at < piece ? spec[i][2] - at : piece;
            c->items[c->n++] = (copy_t){(char *)(uintptr_t)spec[i][0] + at, (const char *)(uintptr_t)spec[i][1] + at, len};
        }
    }
    free(spec);
    return 0;
}

static PyObject *copy_many(PyObject *self, PyObject *args) {
    PyObject *list;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi", &list, &threads)) return NULL;
    copies_t c;
    if (parse_copies(list, &c, COPY_PIECE) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    run_on(run_copies, &c, threads_for(threads, c.n));
    Py_END_ALLOW_THREADS
    free(c.items);
    Py_RETURN_NONE;
}

static PyObject *dio_alignment(PyObject *self, PyObject *args) {
    int fd;
    if (!PyArg_ParseTuple(args, "i", &fd)) return NULL;
    kstatx_t sx;
    if (syscall(SYS_statx, fd, "", AT_EMPTY_PATH, KSTATX_DIOALIGN, &sx) != 0) {
        if (errno == ENOSYS || errno == EPERM) Py_RETURN_NONE;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (!(sx.mask & KSTATX_DIOALIGN)) Py_RETURN_NONE;
    return Py_BuildValue("(III)", sx.dio_mem_align, sx.dio_offset_align, in_place_mem(&sx));
}

/* cudaMemcpyAsync's signature (cudaMemcpyDefault: the direction follows from the addresses). */
typedef int (*memcpy_async_fn)(void *, const void *, size_t, int, void *);
#define CUDA_MEMCPY_DEFAULT 4
#define WHOLE ((size_t)1 << 40)  /* a copy is never cut */

static PyObject *copy_device(PyObject *self, PyObject *args) {
    PyObject *list;
    unsigned long long fn, stream;
    if (!PyArg_ParseTuple(args, "OKK", &list, &fn, &stream)) return NULL;
    if (!fn) {
        PyErr_SetString(PyExc_ValueError, "copy_device needs cudaMemcpyAsync");
        return NULL;
    }
    copies_t c;
    if (parse_copies(list, &c, WHOLE) < 0) return NULL;
    int err = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < c.n && !err; i++)
        err = ((memcpy_async_fn)(uintptr_t)fn)(c.items[i].dst, c.items[i].src, c.items[i].n, CUDA_MEMCPY_DEFAULT,
                                               (void *)(uintptr_t)stream);
    Py_END_ALLOW_THREADS
    free(c.items);
    return PyLong_FromLong(err);
}

static PyObject *staging_need(PyObject *self, PyObject *args) {
    PyObject *list;
    int threads;
    if (!PyArg_ParseTuple(args, "Oi", &list, &threads)) return NULL;
    PyObject *fast = PySequence_Fast(list, "sizes must be a sequence");
    if (!fast) return NULL;
    size_t most = 0;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(fast); i++) {
        size_t t = PyLong_AsSize_t(PySequence_Fast_GET_ITEM(fast, i));
        if (t == (size_t)-1 && PyErr_Occurred()) {
            Py_DECREF(fast);
            return NULL;
        }
        if (t > most) most = t;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    Py_DECREF(fast);
    return PyLong_FromSize_t(staging_for(most) * (size_t)threads_for(threads, n));
}


/* Completions: read_chunks and write_chunks calls that run on threads of their own, collected later. */
typedef struct later_s {
    struct later_s *next;
    struct completions_s *q;
    batch_t b;
    copies_t copies;  /* a copy_later call's (then b is unused) */
    int is_copy;
    int threads, nice, done;
    double done_at;   /* CLOCK_MONOTONIC seconds, once done */
    PyObject *tag;    /* touched with the GIL only */
} later_t;

typedef struct completions_s {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    later_t *head, **tail;  /* started and not collected, oldest first */
    Py_ssize_t running;
    int closed;
    int hurry;  /* callers blocked on a result: finished calls are overdue at once */
} completions_t;

static double mono_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static struct timespec at_time(double t) {
    return (struct timespec){(time_t)t, (long)((t - (double)(time_t)t) * 1e9)};
}

static void finish_later(later_t *l) {
    completions_t *q = l->q;
    pthread_mutex_lock(&q->mu);
    l->done = 1;
    l->done_at = mono_now();
    q->running--;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
}

static void run_work(later_t *l) {
    if (l->is_copy) run_on(run_copies, &l->copies, threads_for(l->threads, l->copies.n));
    else run_threads(&l->b, l->threads);
}

static void *run_later(void *arg) {
    later_t *l = arg;
    if (l->nice > 0) {  /* this thread's nice value; the workers it starts inherit it */
        pid_t tid = (pid_t)syscall(SYS_gettid);
        errno = 0;
        int now = getpriority(PRIO_PROCESS, (id_t)tid);
        if (errno == 0) setpriority(PRIO_PROCESS, (id_t)tid, now + l->nice > 19 ? 19 : now + l->nice);
    }
    run_work(l);
    finish_later(l);
    return NULL;
}

static PyObject *completions_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Completions() takes no arguments");
        return NULL;
    }
    completions_t *q = (completions_t *)type->tp_alloc(type, 0);
    if (!q) return NULL;
    pthread_mutex_init(&q->mu, NULL);
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&q->cv, &attr);
    pthread_condattr_destroy(&attr);
    q->tail = &q->head;
    return (PyObject *)q;
}

/* Only reached once every started call was collected: each holds a reference to the queue. */
static void completions_dealloc(PyObject *self) {
    completions_t *q = (completions_t *)self;
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    Py_TYPE(self)->tp_free(self);
}

/* Queues `l` (its work parsed) as a call of its own, then starts its thread. */
static PyObject *queue_later(completions_t *q, later_t *l, int threads, int nice, PyObject *tag) {
    l->q = q;
    l->threads = threads;
    l->nice = nice;
    Py_INCREF(tag);
    l->tag = tag;
    Py_INCREF((PyObject *)q);
    pthread_mutex_lock(&q->mu);
    *q->tail = l;
    q->tail = &l->next;
    q->running++;
    pthread_mutex_unlock(&q->mu);
    pthread_attr_t attr;
    pthread_t tid;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int started = pthread_create(&tid, &attr, run_later, l) == 0;
    pthread_attr_destroy(&attr);
    if (!started) {  /* no thread to spare: the work runs here, and is collected as any other */
        Py_BEGIN_ALLOW_THREADS
        run_work(l);
        Py_END_ALLOW_THREADS
        finish_later(l);
    }
    Py_RETURN_NONE;
}

/* Parses `list` into b's jobs and queues them as a call of its own. */
static PyObject *start_later(completions_t *q, batch_t b, PyObject *list, int threads, int nice, PyObject *tag) {
    if (!b.crc) {
        PyErr_SetString(PyExc_ValueError, "a later call needs crc32c_extend");
        return NULL;
    }
    later_t *l = calloc(1, sizeof *l);
    if (!l) return PyErr_NoMemory();
    if (!(b.jobs = parse_jobs(list, &b.n, b.writes))) {
        free(l);
        return NULL;
    }
    l->b = b;
    return queue_later(q, l, threads, nice, tag);
}

static PyObject *completions_copy_later(PyObject *self, PyObject *args) {
    PyObject *list, *tag;
    int threads, nice;
    if (!PyArg_ParseTuple(args, "OiiO", &list, &threads, &nice, &tag)) return NULL;
    later_t *l = calloc(1, sizeof *l);
    if (!l) return PyErr_NoMemory();
    if (parse_copies(list, &l->copies, COPY_PIECE) < 0) {
        free(l);
        return NULL;
    }
    l->is_copy = 1;
    return queue_later((completions_t *)self, l, threads, nice, tag);
}

static PyObject *completions_read_later(PyObject *self, PyObject *args) {
    int root, direct, threads, nice;
    PyObject *list, *tag;
    unsigned long long crc_addr, ext_addr;
    Py_ssize_t ext_len;
    if (!PyArg_ParseTuple(args, "iOKpiKniO", &root, &list, &crc_addr, &direct, &threads, &ext_addr, &ext_len, &nice,
                          &tag))
        return NULL;
    batch_t b = {NULL, 0, 0, 0, root, direct, 0, 0, 0, -1, 0, (crc_fn_t)(uintptr_t)crc_addr, 0,
                 (char *)(uintptr_t)ext_addr, (size_t)ext_len, 0};
    return start_later((completions_t *)self, b, list, threads, nice, tag);
}

static PyObject *completions_write_later(PyObject *self, PyObject *args) {
    int root, file_mode, do_chmod, do_sync, direct, threads, dir_mode, dir_chmod, nice;
    PyObject *list, *tag;
    unsigned long long crc_addr, ext_addr;
    Py_ssize_t ext_len;
    if (!PyArg_ParseTuple(args, "iOKipppiKnipiO", &root, &list, &crc_addr, &file_mode, &do_chmod, &do_sync, &direct,
                          &threads, &ext_addr, &ext_len, &dir_mode, &dir_chmod, &nice, &tag))
        return NULL;
    batch_t b = {NULL, 0, 0, 1, root, direct, file_mode, do_chmod, do_sync, dir_mode, dir_chmod,
                 (crc_fn_t)(uintptr_t)crc_addr, 0, (char *)(uintptr_t)ext_addr, (size_t)ext_len, 0};
    return start_later((completions_t *)self, b, list, threads, nice, tag);
}

static PyObject *completions_hurry(PyObject *self, PyObject *args) {
    completions_t *q = (completions_t *)self;
    int delta;
    if (!PyArg_ParseTuple(args, "i", &delta)) return NULL;
    pthread_mutex_lock(&q->mu);
    q->hurry += delta;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    Py_RETURN_NONE;
}

static PyObject *completions_collect(PyObject *self, PyObject *noargs) {
    completions_t *q = (completions_t *)self;
    later_t *done = NULL, **done_tail = &done;
    pthread_mutex_lock(&q->mu);
    for (later_t **at = &q->head; *at;) {
        later_t *l = *at;
        if (!l->done) {
            at = &l->next;
            continue;
        }
        *at = l->next;
        if (q->tail == &l->next) q->tail = at;
        l->next = NULL;
        *done_tail = l;
        done_tail = &l->next;
    }
    pthread_mutex_unlock(&q->mu);
    PyObject *out = PyList_New(0);
    while (done) {
        later_t *l = done;
        done = l->next;
        PyObject *results = !out ? NULL : l->is_copy ? Py_NewRef(Py_None) : PyList_New(l->b.n);
        for (Py_ssize_t i = 0; results && !l->is_copy && i < l->b.n; i++) {
            job_t *j = &l->b.jobs[i];
            PyObject *r = l->b.writes ? PyLong_FromLong(j->err) : Py_BuildValue("(iIii)", j->err, j->crc, j->verified, j->copied);
            if (!r) Py_CLEAR(results);
            else PyList_SET_ITEM(results, i, r);
        }
        PyObject *pair = results ? PyTuple_Pack(2, l->tag, results) : NULL;
        Py_XDECREF(results);
        if (!pair || PyList_Append(out, pair) < 0) Py_CLEAR(out);
        Py_XDECREF(pair);
        Py_DECREF(l->tag);
        if (l->is_copy) free(l->copies.items);
        else free_jobs(l->b.jobs, l->b.n);
        free(l);
        Py_DECREF(self);
    }
    return out;
}

static PyObject *completions_wait_overdue(PyObject *self, PyObject *args) {
    completions_t *q = (completions_t *)self;
    double grace, timeout;
    if (!PyArg_ParseTuple(args, "dd", &grace, &timeout)) return NULL;
    int overdue = 0;
    Py_BEGIN_ALLOW_THREADS
    double deadline = mono_now() + timeout;
    pthread_mutex_lock(&q->mu);
    while (!q->closed) {
        double now = mono_now(), wake = deadline, wait = q->hurry > 0 ? 0.0 : grace;
        for (later_t *l = q->head; l; l = l->next)
            if (l->done && l->done_at + wait < wake) wake = l->done_at + wait;
        if (wake <= now) {
            overdue = wake < deadline;
            break;
        }
        struct timespec ts = at_time(wake);
        pthread_cond_timedwait(&q->cv, &q->mu, &ts);
    }
    pthread_mutex_unlock(&q->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(overdue);
}

static PyObject *completions_wait_idle(PyObject *self, PyObject *args) {
    completions_t *q = (completions_t *)self;
    double timeout;
    if (!PyArg_ParseTuple(args, "d", &timeout)) return NULL;
    int idle;
    Py_BEGIN_ALLOW_THREADS
    double deadline = mono_now() + timeout;
    pthread_mutex_lock(&q->mu);
    while (q->running > 0 && mono_now() < deadline) {
        struct timespec ts = at_time(deadline);
        pthread_cond_timedwait(&q->cv, &q->mu, &ts);
    }
    idle = q->running == 0;
    pthread_mutex_unlock(&q->mu);
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(idle);
}

static PyObject *completions_close(PyObject *self, PyObject *noargs) {
    completions_t *q = (completions_t *)self;
    pthread_mutex_lock(&q->mu);
    q->closed = 1;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
    Py_RETURN_NONE;
}

static PyObject *completions_running(PyObject *self, PyObject *noargs) {
    completions_t *q = (completions_t *)self;
    pthread_mutex_lock(&q->mu);
    Py_ssize_t n = q->running;
    pthread_mutex_unlock(&q->mu);
    return PyLong_FromSsize_t(n);
}

static PyMethodDef completions_methods[] = {
    {"read_later", completions_read_later, METH_VARARGS, "Start a read_chunks call; its results are collected later."},
    {"write_later", completions_write_later, METH_VARARGS, "Start a write_chunks call; its errnos are collected later."},
    {"copy_later", completions_copy_later, METH_VARARGS, "Start a copy_many call; collected later (results None)."},
    {"hurry", completions_hurry, METH_VARARGS,
     "Add to the count of callers blocked on a result (wait_overdue does not wait out the grace while positive)."},
    {"collect", completions_collect, METH_NOARGS, "[(tag, results)] of every call finished and not yet collected."},
    {"wait_overdue", completions_wait_overdue, METH_VARARGS,
     "Block (GIL released) until a finished call went uncollected for grace seconds, or timeout, or close."},
    {"wait_idle", completions_wait_idle, METH_VARARGS, "Block (GIL released) until no call runs, or timeout."},
    {"close", completions_close, METH_NOARGS, "Wake every wait_overdue; calls already started still finish."},
    {"running", completions_running, METH_NOARGS, "How many calls are still running."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CompletionsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "gdskv.io._batchio.Completions",
    .tp_basicsize = sizeof(completions_t),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "read_chunks and write_chunks calls that finish on threads of their own and are collected later.",
    .tp_new = completions_new,
    .tp_dealloc = completions_dealloc,
    .tp_methods = completions_methods,
};

static PyMethodDef methods[] = {
    {"stat_chunks", stat_chunks, METH_VARARGS, "Whether each store key's chunk is a regular file of the size."},
    {"chunk_mtimes", chunk_mtimes, METH_VARARGS, "Each store key's chunk's mtime in ns, where it is a regular file of the size."},
    {"lease_chunks", lease_chunks, METH_VARARGS, "Set times of each store key's chunk (see the module source)."},
    {"copy_many", copy_many, METH_VARARGS, "Host-memory copies (dst, src, length) on this many threads."},
    {"copy_device", copy_device, METH_VARARGS, "Host/device copies (dst, src, length) queued on a CUDA stream."},
    {"dio_alignment", dio_alignment, METH_VARARGS, "statx's direct-I/O (memory, offset) alignment of a file, or None."},
    {"staging_need", staging_need, METH_VARARGS, "Staging bytes a call of chunks of these sizes needs on this many threads."},
    {"read_chunks", read_chunks, METH_VARARGS, "Read and checksum a batch of chunk files (see the module source)."},
    {"write_chunks", write_chunks, METH_VARARGS, "Write and publish a batch of chunk files (see the module source)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_batchio", NULL, -1, methods};

PyMODINIT_FUNC PyInit__batchio(void) {
    PyObject *m = PyModule_Create(&module);
    if (m && (PyType_Ready(&CompletionsType) < 0 || PyModule_AddObjectRef(m, "Completions", (PyObject *)&CompletionsType) < 0))
        Py_CLEAR(m);
    if (m) {
        PyModule_AddIntConstant(m, "ERR_SHORT", ERR_SHORT);
        PyModule_AddIntConstant(m, "ERR_NOT_REGULAR", ERR_NOT_REGULAR);
        PyModule_AddIntConstant(m, "ERR_PRESENT", ERR_PRESENT);
        PyModule_AddIntConstant(m, "MAX_PIECES", MAX_PIECES);
    }
    return m;
}
