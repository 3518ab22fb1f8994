package node

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/harvester-csi/harvester-csi-driver/internal/nodetest"
	"github.com/harvester-csi/harvester-csi-driver/pkg/driver"
)

const rwx = csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER

// fakeExports answers the node's lookup of an export on the host.
type fakeExports struct {
	endpoint, export string
	err              error
	asked            []string
}

func (f *fakeExports) NFSExport(_ context.Context, volume string) (string, string, string, error) {
	f.asked = append(f.asked, volume)
	return f.endpoint, f.export, "", f.err
}

// An RWX stage or publish with bad input is refused before anything is
// mounted, with the code and a message that names the volume.
func TestNFSRequestValidation(t *testing.T) {
	ctx := testContext(t)
	dir := t.TempDir()
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "target")
	for _, c := range []struct {
		name string
		pc   map[string]string
		cap  *csi.VolumeCapability
		want codes.Code
	}{
		{"no publish context", nil, mountCap("", rwx), codes.InvalidArgument},
		{"endpoint that is an option", map[string]string{"nfsEndpoint": "-oro", "nfsExport": "/pvc-1"}, mountCap("", rwx), codes.InvalidArgument},
		{"endpoint with a second server", map[string]string{"nfsEndpoint": "10.0.0.1,10.0.0.2", "nfsExport": "/pvc-1"}, mountCap("", rwx), codes.InvalidArgument},
		{"relative export", map[string]string{"nfsEndpoint": "10.0.0.1", "nfsExport": "../pvc-1"}, mountCap("", rwx), codes.InvalidArgument},
		{"block RWX", map[string]string{"nfsEndpoint": "10.0.0.1", "nfsExport": "/pvc-1"}, blockRWX(), codes.InvalidArgument},
	} {
		_, err := plainNode(t, nil).NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "pvc-1", StagingTargetPath: staging, VolumeCapability: c.cap, PublishContext: c.pc})
		// A capability is refused for what it is; everything else names the volume.
		if status.Code(err) != c.want || (c.cap.GetBlock() == nil && !strings.Contains(err.Error(), "pvc-1")) {
			t.Errorf("%s: %v, want %s naming the volume", c.name, err, c.want)
		}
	}
	// Without a publish context the node asks the host; a host that does not
	// know is a retryable answer.
	exports := &fakeExports{err: errors.New("NetworkFilesystem harvester-system/pv-1 is not serving")}
	ns := plainNode(t, func(o *driver.NodeOptions) { o.Exports = exports })
	_, err := ns.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "pvc-1", StagingTargetPath: staging, VolumeCapability: mountCap("", rwx)})
	if status.Code(err) != codes.Unavailable || len(exports.asked) != 1 || exports.asked[0] != "pvc-1" {
		t.Errorf("stage without a publish context: %v (asked %v), want Unavailable after asking the host about pvc-1", err, exports.asked)
	}
	// Publish of an RWX volume whose staging path has no NFS mount.
	if err := os.MkdirAll(staging, 0o750); err != nil {
		t.Fatal(err)
	}
	_, err = plainNode(t, nil).NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "pvc-1", StagingTargetPath: staging, TargetPath: target, VolumeCapability: mountCap("", rwx)})
	if status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), "pvc-1") {
		t.Errorf("publish with nothing staged: %v, want FailedPrecondition naming the volume", err)
	}
	if _, err := os.Lstat(target); !os.IsNotExist(err) {
		t.Errorf("publish that failed left %s behind (%v)", target, err)
	}
}

func blockRWX() *csi.VolumeCapability {
	c := blockCap()
	c.AccessMode.Mode = rwx
	return c
}

// nfsAvailable says why this machine cannot mount NFS, or "".
func nfsAvailable() string {
	fs, err := os.ReadFile("/proc/filesystems")
	if err != nil {
		return "cannot read /proc/filesystems: " + err.Error()
	}
	if !strings.Contains(string(fs), "\tnfs") {
		return "the kernel has no NFS client (no nfs in /proc/filesystems; this kernel may be built without CONFIG_NFS_FS and without module support)"
	}
	if _, err := exec.LookPath("mount.nfs"); err != nil {
		return "mount.nfs is not installed (nfs-common)"
	}
	return ""
}

// TestNFSStagePublishOnARealServer stages, publishes, writes through, and
// unpublishes and unstages a real NFS export. It needs root, the kernel NFS
// client, mount.nfs and a server: HCSI_NFS_EXPORT=<server>:/<export>.
func TestNFSStagePublishOnARealServer(t *testing.T) {
	nodetest.RequireRealDevices(t)
	if why := nfsAvailable(); why != "" {
		t.Skip("no NFS here: " + why)
	}
	spec := os.Getenv("HCSI_NFS_EXPORT")
	server, export, ok := strings.Cut(spec, ":")
	if !ok {
		t.Skip("no NFS server to test against: set HCSI_NFS_EXPORT=<server>:/<export>")
	}
	ctx := testContext(t)
	dir := t.TempDir()
	nodetest.CleanupMounts(t, dir)
	staging, target := filepath.Join(dir, "staging"), filepath.Join(dir, "pods", "pvc-nfs", "mount")
	ns := plainNode(t, nil)
	c := mountCap("", rwx)
	pc := map[string]string{"nfsEndpoint": server, "nfsExport": export}
	for range 2 { // repeated: the export is already staged
		if _, err := ns.NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{VolumeId: "pvc-nfs", StagingTargetPath: staging, VolumeCapability: c, PublishContext: pc}); err != nil {
			t.Fatalf("stage: %v", err)
		}
	}
	for range 2 {
		if _, err := ns.NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{VolumeId: "pvc-nfs", StagingTargetPath: staging, TargetPath: target, VolumeCapability: c, PublishContext: pc}); err != nil {
			t.Fatalf("publish: %v", err)
		}
	}
	if err := os.WriteFile(filepath.Join(target, "hello"), []byte("rwx"), 0o600); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(staging, "hello")); err != nil || string(b) != "rwx" {
		t.Errorf("written through the target, read on the staging mount: %q, %v", b, err)
	}
	_ = os.Remove(filepath.Join(target, "hello"))
	if _, err := ns.NodeUnpublishVolume(ctx, &csi.NodeUnpublishVolumeRequest{VolumeId: "pvc-nfs", TargetPath: target}); err != nil {
		t.Fatalf("unpublish: %v", err)
	}
	if _, err := ns.NodeUnstageVolume(ctx, &csi.NodeUnstageVolumeRequest{VolumeId: "pvc-nfs", StagingTargetPath: staging}); err != nil {
		t.Fatalf("unstage: %v", err)
	}
}
