"""File operations confined to one directory tree: the store never reaches outside its root.

Every path gdskv deletes, moves, renames, creates, writes or touches inside a store goes through a
``ConfinedDir``. Paths are resolved by the kernel relative to a descriptor of the store's root,
never following a symbolic link and never leaving the root (``openat2`` with
``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``; on kernels without it, one ``O_NOFOLLOW`` open per
component). The last component is acted on through its parent's descriptor (``unlinkat``,
``renameat``, ``utimensat`` without following): a link where a chunk or a directory should be is
moved or removed as the link itself, and whatever it points to is left alone. Data files are
opened non-blocking and checked to be regular files, so a FIFO, a socket or a device at a chunk
path is refused at once rather than waited on.

Called by ``gdskv.store`` (namespaces, quarantine, stats, the directory walk), ``gdskv.transfer``
(every chunk save and load), ``gdskv.garbage`` and ``gdskv.eviction``. Errors are ``OSError``s;
a path that would escape or cross a link raises ``OutsideStoreError``.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Optional

_SYS_OPENAT2 = 437  # the same number on every Linux architecture (Linux 5.6+)
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_RESOLVE_BENEATH = 0x08
_libc = ctypes.CDLL(None, use_errno=True)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class OutsideStoreError(OSError):
    """A path that would leave the store or pass through a symbolic link."""


class NotRegularFileError(OSError):
    """Something other than a regular file (a FIFO, socket, device, directory) where data belongs."""


def _process_umask() -> int:
    """This process's umask, read without changing it (``os.umask`` would, racing other threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


_UMASK = _process_umask()


def umask_may_strip(mode: int) -> bool:
    """Whether a create with ``mode`` needs an explicit chmod: the umask (read once at start; a
    process may change it later) strips some of its bits, or it grants group/other bits, which a
    later umask could strip."""
    return bool(mode & (_UMASK | 0o077))
_openat2_works = True

_UTIME_NOW, _UTIME_OMIT = (1 << 30) - 1, (1 << 30) - 2
_AT_SYMLINK_NOFOLLOW = 0x100


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_MTIME_NOW = (_Timespec * 2)(_Timespec(0, _UTIME_OMIT), _Timespec(0, _UTIME_NOW))


def touch_mtime(name: str, dir_fd: int) -> None:
    """Set the entry's own mtime (never a link's target's) to now and leave its atime alone, so a
    lease (an atime set ahead by a lookup) outlives the loads of other requests. Called by
    ``gdskv.transfer`` after each verified load on the per-page path (the native path does the
    same in C); ``OSError`` on failure."""
    if _libc.utimensat(dir_fd, os.fsencode(name), _MTIME_NOW, _AT_SYMLINK_NOFOLLOW) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), name)


def _split(rel: str) -> list[str]:
    parts = [p for p in rel.split("/") if p and p != "."]
    if any(p == ".." for p in parts):
        raise OutsideStoreError(errno.EXDEV, "path leaves the store", rel)
    return parts


@dataclass(frozen=True)
class Entry:
    """One directory entry as ``ConfinedDir.scandir`` reports it (never following links)."""

    name: str
    kind: str  # "file", "dir", "link" or "other"
    st: Optional[os.stat_result]


class ConfinedDir:
    """A directory tree (a store's root) and the only operations gdskv performs inside it.

    ``path`` arguments are either relative to the root or absolute paths that start with
    ``root`` as given (the form ``Namespace.chunk_path`` builds); anything else is refused.
    ``file_mode`` / ``dir_mode`` are applied exactly (whatever the umask) to every file and
    directory created here.
    """

    def __init__(self, root: str | os.PathLike, file_mode: int = 0o600, dir_mode: int = 0o700) -> None:
        self.root = os.path.abspath(os.fspath(root))
        self._prefix = self.root.rstrip("/") + "/"
        self.file_mode = file_mode
        self.dir_mode = dir_mode
        self._lock = threading.Lock()
        self._fd = os.open(self.root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    # --- paths ---------------------------------------------------------------------------------
    def rel(self, path: str | os.PathLike) -> str:
        """``path`` relative to the root; ``OutsideStoreError`` for a path not under it."""
        p = os.fspath(path)
        if os.path.isabs(p):
            if not p.startswith(self._prefix):
                raise OutsideStoreError(errno.EXDEV, "path is not inside the store", p)
            p = p[len(self._prefix):]
        return "/".join(_split(p))

    def abspath(self, rel: str) -> str:
        return f"{self._prefix}{rel}" if rel else self.root

    @property
    def fd(self) -> int:
        """The root's descriptor (``O_PATH``), for ``gdskv.io.batch``, which resolves paths beneath
        it the same way."""
        return self._fd

    @property
    def alive(self) -> bool:
        """False once the root directory was removed (``rm -rf`` of the store under a server)."""
        try:
            return os.fstat(self._fd).st_nlink > 0
        except OSError:
            return False

    # --- opening -------------------------------------------------------------------------------
    def open(self, path: str | os.PathLike, flags: int, mode: Optional[int] = None) -> int:
        """A descriptor for ``path`` inside the store, resolved without following any link.
        ``O_CREAT`` creates with ``file_mode`` (or ``mode``); a file that already exists is opened
        as it is, its mode untouched (it may be a hard link to a file outside the store)."""
        if flags & os.O_CREAT and not flags & os.O_EXCL:
            try:
                return self.open(path, flags | os.O_EXCL, mode)
            except FileExistsError:
                flags &= ~os.O_CREAT
        rel = self.rel(path)
        mode = self.file_mode if mode is None else mode
        flags |= os.O_CLOEXEC | os.O_NOFOLLOW
        try:
            fd = self._open_beneath(rel, flags, mode)
        except NotADirectoryError:
            if flags & os.O_DIRECTORY and self._is_link(rel):
                raise OutsideStoreError(errno.ELOOP, "path is a symbolic link", self.abspath(rel)) from None
            raise
        return _with_mode(fd, mode) if flags & os.O_CREAT else fd

    def _open_beneath(self, rel: str, flags: int, mode: int) -> int:
        global _openat2_works
        if not rel:
            return os.open(".", flags & ~os.O_NOFOLLOW, dir_fd=self._fd)
        if _openat2_works:
            how = _OpenHow(flags, mode if flags & os.O_CREAT else 0,
                           _RESOLVE_BENEATH | _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
            fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(self._fd), rel.encode(), ctypes.byref(how),
                               ctypes.c_size_t(ctypes.sizeof(how)))
            if fd >= 0:
                return fd
            err = ctypes.get_errno()
            if err not in (errno.ENOSYS, errno.EPERM):  # EPERM: a seccomp filter without openat2
                if err in (errno.ELOOP, errno.EXDEV):
                    raise OutsideStoreError(err, "path crosses a symbolic link or leaves the store", self.abspath(rel))
                raise OSError(err, os.strerror(err), self.abspath(rel))
            _openat2_works = False
        return self._open_walk(rel, flags, mode)

    def _is_link(self, rel: str) -> bool:
        try:
            fd = self._open_beneath(rel, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, 0)
        except OSError:
            return False
        try:
            return stat.S_ISLNK(os.fstat(fd).st_mode)
        finally:
            os.close(fd)

    def _open_walk(self, rel: str, flags: int, mode: int) -> int:
        """``openat2``'s confinement by hand: one ``O_NOFOLLOW`` directory open per component."""
        parts = _split(rel)
        fd = os.dup(self._fd)
        try:
            for part in parts[:-1]:
                try:
                    nxt = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except NotADirectoryError:
                    if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise OutsideStoreError(errno.ELOOP, "path crosses a symbolic link", self.abspath(rel)) from None
                    raise
                os.close(fd)
                fd = nxt
            try:
                return os.open(parts[-1], flags, mode, dir_fd=fd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise OutsideStoreError(errno.ELOOP, "path is a symbolic link", self.abspath(rel)) from None
                raise
        finally:
            os.close(fd)

    @contextmanager
    def directory(self, path: str | os.PathLike, create: bool = False) -> Iterator[int]:
        """A descriptor of the directory ``path`` (made, with its parents, when ``create``)."""
        rel = self.rel(path)
        try:
            fd = self.open(rel, os.O_PATH | os.O_DIRECTORY)
        except FileNotFoundError:
            if not create:
                raise
            self.makedirs(rel)
            fd = self.open(rel, os.O_PATH | os.O_DIRECTORY)
        try:
            yield fd
        finally:
            os.close(fd)

    def open_regular(self, path: str | os.PathLike, flags: int = os.O_RDONLY) -> int:
        """Open an existing data file: non-blocking, never a link, and refused unless it is a
        regular file (``NotRegularFileError``). The descriptor is left blocking-mode neutral
        (``O_NONBLOCK`` cleared) for regular-file I/O."""
        fd = self.open(path, flags | os.O_NONBLOCK)
        return check_regular(fd, self.abspath(self.rel(path)))

    # --- changing the tree ---------------------------------------------------------------------
    def makedirs(self, path: str | os.PathLike) -> None:
        """Make ``path`` and its missing parents with ``dir_mode``; a link on the way is refused."""
        parts = _split(self.rel(path))
        for i in range(1, len(parts) + 1):
            parent, name = "/".join(parts[:i - 1]), parts[i - 1]
            pfd = self.open(parent, os.O_PATH | os.O_DIRECTORY)
            try:
                os.mkdir(name, self.dir_mode, dir_fd=pfd)
                if umask_may_strip(self.dir_mode):
                    os.chmod(name, self.dir_mode, dir_fd=pfd, follow_symlinks=False)
            except FileExistsError:
                pass
            finally:
                os.close(pfd)

    @contextmanager
    def _parent(self, path: str | os.PathLike) -> Iterator[tuple[int, str]]:
        parts = _split(self.rel(path))
        if not parts:
            raise OutsideStoreError(errno.EINVAL, "refusing to act on the store root itself", self.root)
        fd = self.open("/".join(parts[:-1]), os.O_PATH | os.O_DIRECTORY)
        try:
            yield fd, parts[-1]
        finally:
            os.close(fd)

    def unlink(self, path: str | os.PathLike) -> None:
        """Remove the entry (a link is removed as a link)."""
        with self._parent(path) as (fd, name):
            os.unlink(name, dir_fd=fd)

    def rmdir(self, path: str | os.PathLike) -> None:
        with self._parent(path) as (fd, name):
            os.rmdir(name, dir_fd=fd)

    def rename(self, src: str | os.PathLike, dst: str | os.PathLike) -> None:
        """Move an entry within the store (a link moves as a link), replacing ``dst``."""
        with self._parent(src) as (sfd, sname), self._parent(dst) as (dfd, dname):
            os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)

    def link_noreplace(self, src: str | os.PathLike, dst: str | os.PathLike) -> None:
        """Give the file at ``src`` the name ``dst`` too, unless ``dst`` exists
        (``FileExistsError``): an atomic "put back unless replaced" for eviction's veto."""
        with self._parent(src) as (sfd, sname), self._parent(dst) as (dfd, dname):
            os.link(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)

    def utime(self, path: str | os.PathLike, ns: Optional[tuple[int, int]] = None) -> None:
        """Set the entry's own times (a link's, never its target's)."""
        with self._parent(path) as (fd, name):
            os.utime(name, ns=ns, dir_fd=fd, follow_symlinks=False)

    def lstat(self, path: str | os.PathLike) -> os.stat_result:
        with self._parent(path) as (fd, name):
            return os.stat(name, dir_fd=fd, follow_symlinks=False)

    def write_atomic(self, path: str | os.PathLike, data: bytes, tmp_suffix: str) -> None:
        """Write ``data`` to ``path`` through a temporary file beside it (named ``path`` +
        ``tmp_suffix``, which ``gdskv gc`` recognises), made with ``file_mode``, then renamed into
        place; the temporary file is removed on failure. Parent directories are made."""
        rel = self.rel(path)
        tmp = rel + tmp_suffix
        parent = rel.rpartition("/")[0]
        if parent:
            self.makedirs(parent)
        fd = self.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            self.rename(tmp, rel)
        except BaseException:
            try:
                self.unlink(tmp)
            except OSError:
                pass
            raise

    def read_small(self, path: str | os.PathLike, limit: int = 16 << 20) -> bytes:
        """The bytes of a small regular file (metadata), refused beyond ``limit`` bytes."""
        fd = self.open_regular(path)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise OSError(errno.EFBIG, f"metadata file larger than {limit} bytes", self.abspath(self.rel(path)))
            chunks, left = [], size + 1
            while left > 0:
                b = os.read(fd, left)
                if not b:
                    break
                chunks.append(b)
                left -= len(b)
            return b"".join(chunks)
        finally:
            os.close(fd)

    # --- reading the tree ----------------------------------------------------------------------
    def scandir(self, path: str | os.PathLike, with_stat: bool = False) -> list[Entry]:
        """The entries of a directory inside the store (empty when it is missing or not a
        directory), each with its kind judged without following links and, with ``with_stat``,
        its own ``lstat`` (entries removed meanwhile are left out)."""
        try:
            fd = self.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except (FileNotFoundError, NotADirectoryError, OutsideStoreError):
            return []
        out = []
        try:
            with os.scandir(fd) as it:
                for e in it:
                    try:
                        if e.is_symlink():
                            kind = "link"
                        elif e.is_dir(follow_symlinks=False):
                            kind = "dir"
                        elif e.is_file(follow_symlinks=False):
                            kind = "file"
                        else:
                            kind = "other"
                        st = e.stat(follow_symlinks=False) if with_stat else None
                    except FileNotFoundError:
                        continue
                    out.append(Entry(e.name, kind, st))
        finally:
            os.close(fd)
        return out

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def check_regular(fd: int, path: str) -> int:
    """``fd`` when it is a regular file (its ``O_NONBLOCK`` cleared); otherwise close it and raise
    ``NotRegularFileError``. Called by ``ConfinedDir.open_regular`` and by the I/O engines, which
    open chunk files non-blocking so a FIFO can never stall them."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegularFileError(errno.EINVAL, f"not a regular file ({_kind(st.st_mode)})", path)
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
        if flags & os.O_NONBLOCK:
            fcntl.fcntl(fd, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_data_file(path: str, write: bool, mode: int = 0o600) -> int:
    """Open a chunk file for an I/O engine: never through a link at its last component
    (``O_NOFOLLOW``), non-blocking so a FIFO cannot stall the open, refused unless it is a
    regular file. ``write`` creates it, new, with exactly ``mode``: writes go to temp names,
    and whatever already has the name (a crashed process's temp file, or a hard link planted to
    a file outside the store) is unlinked first, never written through. Called by the POSIX
    and kvikio engines for every read and write; ``gdskv.transfer`` hands them paths whose
    directory part is already confined (``dir_path``)."""
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    if not write:
        return check_regular(os.open(path, flags | os.O_RDONLY), path)
    flags |= os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:
        os.unlink(path)
        fd = os.open(path, flags, mode)
    return _with_mode(check_regular(fd, path), mode)


def _with_mode(fd: int, mode: int) -> int:
    """``fd`` of a file just created with ``mode``, given exactly that mode where the umask may
    have stripped bits of it (closed on failure)."""
    if umask_may_strip(mode):
        try:
            os.fchmod(fd, mode)
        except OSError:
            os.close(fd)
            raise
    return fd


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISLNK, "a link")):
        if test(mode):
            return name
    return "not a file"


def dir_path(fd: int, name: str = "") -> str:
    """A path that names ``name`` inside the directory open at ``fd`` (through ``/proc/self/fd``),
    for engines that take paths: resolution starts at that very directory, whatever was renamed
    or linked since it was opened. Called by ``gdskv.transfer`` for each chunk it moves."""
    return f"/proc/self/fd/{fd}/{name}" if name else f"/proc/self/fd/{fd}"
