package mountinfo

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

const sample = `22 1 0:21 / / rw,relatime shared:1 - ext4 /dev/vda1 rw
36 22 7:3 / /var/lib/kubelet/plugins/kubernetes.io/csi/driver.harvesterhci.io/abc/globalmount rw,relatime shared:20 - ext4 /dev/loop3 rw
37 22 7:3 / /var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pvc-1/mount ro,relatime shared:20 - ext4 /dev/loop3 rw
38 22 0:5 /loop4 /var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/pvc-2/p rw,nosuid master:2 - devtmpfs udev rw,size=1k
39 22 0:40 / /mnt/with\040space\134x rw - tmpfs tmp rw
40 22 0:41 / /mnt/noopt rw - tmpfs tmp
`

func TestParse(t *testing.T) {
	ms, err := Parse(strings.NewReader(sample))
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 6 {
		t.Fatalf("got %d mounts", len(ms))
	}
	m := ms[1]
	if m.ID != 36 || m.ParentID != 22 || m.Major != 7 || m.Minor != 3 || m.Root != "/" || m.FSType != "ext4" || m.Source != "/dev/loop3" || m.SuperOpts != "rw" {
		t.Fatalf("bad parse: %+v", m)
	}
	if ms[3].Root != "/loop4" || ms[3].FSType != "devtmpfs" {
		t.Fatalf("bad bind parse: %+v", ms[3])
	}
	if ms[4].MountPoint != `/mnt/with space\x` {
		t.Fatalf("unescape: %q", ms[4].MountPoint)
	}
	if got := OnDevice(ms, 7, 3); len(got) != 2 {
		t.Fatalf("OnDevice: %v", got)
	}
	if at, ok := At(ms, "/var/lib/kubelet/pods/p/volumes/kubernetes.io~csi/pvc-1/mount/"); !ok || at.ID != 37 {
		t.Fatalf("At: %+v %v", at, ok)
	}
	if _, ok := At(ms, "/var/lib/kubelet"); ok {
		t.Fatal("At matched a non-mount point")
	}
}

func TestParseRejectsGarbage(t *testing.T) {
	for _, bad := range []string{"1 2 3", "x 1 0:1 / / rw - ext4 a b", "1 1 01 / / rw - ext4 a b", "1 1 0:1 / / rw ext4 a b"} {
		if _, err := Parse(strings.NewReader(bad)); err == nil {
			t.Errorf("accepted %q", bad)
		}
	}
}

func TestReadSelf(t *testing.T) {
	ms, err := Read("")
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := At(ms, "/"); !ok {
		t.Fatal("no root mount in /proc/self/mountinfo")
	}
}

// A symlink as the last component is never "the mount at" a path, even when
// it points at one: unmounting or publishing through it would act on the
// link's destination.
func TestAtDoesNotFollowTheLastComponent(t *testing.T) {
	dir := t.TempDir()
	real, err := filepath.EvalSymlinks(dir)
	if err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link")
	if err := os.Symlink("/", link); err != nil {
		t.Fatal(err)
	}
	ms := []Mount{{ID: 1, MountPoint: "/"}, {ID: 2, MountPoint: filepath.Join(real, "mnt")}}
	if m, ok := At(ms, link); ok {
		t.Fatalf("At followed the link to %+v", m)
	}
	if m, ok := At(ms, filepath.Join(dir, "mnt")); !ok || m.ID != 2 {
		t.Fatalf("At of a real mount point: %+v %v", m, ok)
	}
	if got := Canonical(link); got != filepath.Join(real, "link") {
		t.Fatalf("Canonical(%s) = %s", link, got)
	}
}
