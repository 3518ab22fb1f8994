package node

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"

	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
)

// A volume whose node died comes to another node with its filesystem never
// unmounted. The test leaves it in that state on a real loop device: it is
// staged on vm-a, a file is written and synced, and the filesystem is shut
// down the way a power cut stops it (the FS_IOC_SHUTDOWN ioctl through
// `xfs_io -x -c shutdown`, which xfstests uses to simulate a crash: nothing
// more reaches the disk, not even the journal's or log's last state), then
// the mount is dropped and the disk moves to vm-b. On disk that is exactly a
// forced detach: an ext4 with needs_recovery and a journal to replay, an XFS
// with a dirty log. Some cases then add damage with debugfs/xfs_db on the
// backing file: the error state ext4 records when its writes start to fail
// (the disk pulled from under a live mount), and inconsistencies no automatic
// check may repair.
func TestStageAfterAForcedDetach(t *testing.T) {
	for _, tc := range []struct {
		name, fsType string
		size         int64
		// damage works on the disk's backing file after the crash.
		damage func(t *testing.T, file string)
		// want is the stage's answer on vm-b: OK, or the code.
		want codes.Code
	}{
		{name: "ext4 with a journal to replay", fsType: "ext4", size: 64 * mib, want: codes.OK},
		{name: "ext4 with errors recorded", fsType: "ext4", size: 64 * mib, want: codes.OK,
			damage: func(t *testing.T, file string) {
				// s_state EXT2_ERROR_FS (2): the kernel's "errors detected"
				// mark, which only a full check clears.
				nodetest.Run(t, "debugfs", "-w", "-R", "ssv state 2", file)
			}},
		{name: "ext4 that needs a manual fsck", fsType: "ext4", size: 64 * mib, want: codes.FailedPrecondition,
			damage: func(t *testing.T, file string) {
				// A root inode cleared is beyond preen mode ("UNEXPECTED
				// INCONSISTENCY; RUN fsck MANUALLY", exit 4). The journal
				// is replayed first, or its copy of the inode table
				// block would bring the root inode back.
				nodetest.Run(t, "e2fsck", "-E", "journal_only", "-p", file)
				nodetest.Run(t, "debugfs", "-w", "-R", "clri <2>", file)
				nodetest.Run(t, "debugfs", "-w", "-R", "ssv state 2", file)
			}},
		{name: "xfs with a dirty log", fsType: "xfs", size: 320 * mib, want: codes.OK},
		{name: "xfs that is corrupt", fsType: "xfs", size: 320 * mib, want: codes.FailedPrecondition,
			damage: func(t *testing.T, file string) {
				// The root inode's magic number gone: the kernel refuses
				// the mount (EUCLEAN), xfs_repair -n reports corruption.
				nodetest.Run(t, "xfs_db", "-x", "-c", "inode 128", "-c", "write -d core.magic 0", file)
			}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tools := []string{"xfs_io", "e2fsck"}
			if tc.fsType == "xfs" {
				tools = append(tools, "mkfs.xfs", "xfs_db", "xfs_repair")
			} else {
				tools = append(tools, "debugfs", "dumpe2fs")
			}
			h := newHarness(t, tc.size, tools...)
			ctx := testContext(t)
			vol := "pvc-dirty"
			c := mountCap(tc.fsType, rwo)

			a := h.node("vm-a", nil)
			h.plug("vm-a", vol)
			stagingA, _ := a.paths(vol, "pod")
			must(t, a.stage(ctx, vol, stagingA, c), "stage on vm-a")
			writeSynced(t, filepath.Join(stagingA, "data"), "written before the crash")
			nodetest.Run(t, "xfs_io", "-x", "-c", "shutdown", stagingA)
			must(t, unix.Unmount(stagingA, 0), "drop vm-a's mount")
			h.unplug("vm-a", vol)
			if tc.damage != nil {
				tc.damage(t, h.disks.BackingFile(vol))
			}

			b := h.node("vm-b", nil)
			dev := h.plug("vm-b", vol)
			stagingB, _ := b.paths(vol, "pod")
			err := b.stage(ctx, vol, stagingB, c)
			if tc.want != codes.OK {
				wantCode(t, err, tc.want, "stage of a filesystem that needs a repair by hand")
				if !strings.Contains(err.Error(), "repair it by hand") || !strings.Contains(err.Error(), dev) {
					t.Errorf("the refusal does not say what to do about which disk: %v", err)
				}
				if isMountPoint(t, stagingB) {
					t.Fatal("the damaged filesystem was mounted")
				}
				return
			}
			must(t, err, "stage on vm-b")
			got, err := os.ReadFile(filepath.Join(stagingB, "data"))
			if err != nil || string(got) != "written before the crash" {
				t.Fatalf("synced data after the crash: %q, %v", got, err)
			}
			must(t, b.unstage(ctx, vol, stagingB), "unstage on vm-b")
			if tc.fsType == "ext4" {
				// Checked and repaired before the mount, not mounted with
				// its errors (which the kernel keeps until a full check).
				if out := nodetest.Run(t, "dumpe2fs", "-h", dev); strings.Contains(out, "with errors") {
					t.Errorf("the filesystem was mounted without its errors repaired:\n%s", out)
				}
			}
		})
	}
}

func writeSynced(t *testing.T, path, content string) {
	t.Helper()
	f, err := os.Create(path)
	must(t, err, "create "+path)
	_, err = f.WriteString(content)
	must(t, err, "write "+path)
	must(t, f.Sync(), "fsync "+path)
	must(t, f.Close(), "close "+path)
}
