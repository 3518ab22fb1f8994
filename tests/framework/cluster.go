package framework

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/harvester-csi/harvester-csi-driver/internal/checkout"
	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/internal/simguest"
	"github.com/harvester-csi/harvester-csi-driver/internal/simguest/chart"
	"github.com/harvester-csi/harvester-csi-driver/internal/simhost"
	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
)

// ClusterOptions configure StartCluster.
type ClusterOptions struct {
	// Sim is the KubeVirt the host runs (mode, version, scale).
	Sim kubevirtsim.Options
	// Nodes are the guest nodes, one host VM each, Ready when StartCluster
	// returns.
	Nodes []string
	// Verbosity of the guest components' logs (5: the sidecars log each CSI
	// request they send).
	Verbosity int
}

// Cluster is a simulated Harvester with real loop-device disks and a real
// guest control plane (internal/simguest) running the driver built from
// this checkout with the chart's manifests.
type Cluster struct {
	Host      *simhost.Host
	Guest     *simguest.Guest
	Manifests *chart.Manifests
}

// StartCluster starts a Cluster; it is stopped when t ends, and if t failed
// the end of every component's log is shown. It skips t unless it runs as
// root (loop devices, mounts) and not in -short mode.
func StartCluster(ctx context.Context, t testing.TB, o ClusterOptions) *Cluster {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("the guest's kubelet needs root (loop devices, mounts)")
	}
	if testing.Short() {
		t.Skip("starts two control planes")
	}
	bin, err := testenv.BinDir()
	if err != nil {
		t.Fatal(err)
	}
	work := t.TempDir()
	// Unix socket paths are limited to 107 bytes: not under the test's
	// (long) temporary directory.
	sockets, err := os.MkdirTemp("/tmp", "hcsi-guest-")
	if err != nil {
		t.Fatal(err)
	}
	driverBin := BuildDriver(t, work)
	root, err := checkout.Root()
	if err != nil {
		t.Fatal(err)
	}
	m, err := chart.Load(filepath.Join(root, chart.File))
	if err != nil {
		t.Fatal(err)
	}
	logs := filepath.Join(work, "logs")
	h, err := simhost.Start(ctx, simhost.Options{Dir: filepath.Join(work, "host"), LogDir: logs, Sim: o.Sim,
		VMs: o.Nodes, Disks: true, HardUnplug: true, Harvester: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Stop(context.Background()) })
	g, err := simguest.Start(ctx, simguest.Options{Dir: filepath.Join(work, "guest"), SocketDir: sockets, LogDir: logs,
		Bin: bin, DriverBinary: driverBin, Manifests: m, Host: h, NodeStatusUpdate: 2 * time.Second,
		Verbosity: o.Verbosity})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = g.Stop(context.Background())
		unmountAllUnder(t, sockets)
		_ = os.RemoveAll(sockets)
		if t.Failed() {
			logTails(t, logs)
		}
	})
	for _, n := range o.Nodes {
		if _, err := g.AddNode(ctx, n); err != nil {
			t.Fatal(err)
		}
	}
	if err := g.WaitNodesReady(ctx, o.Nodes); err != nil {
		t.Fatal(err)
	}
	return &Cluster{Host: h, Guest: g, Manifests: m}
}

// CreateClaim creates a 1Gi claim name in ns of the chart's StorageClass
// with access mode mode.
func (c *Cluster) CreateClaim(ctx context.Context, t testing.TB, ns, name string, mode corev1.PersistentVolumeAccessMode) {
	t.Helper()
	if _, err := c.Guest.Kube.CoreV1().PersistentVolumeClaims(ns).Create(ctx, &corev1.PersistentVolumeClaim{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PersistentVolumeClaimSpec{
			AccessModes:      []corev1.PersistentVolumeAccessMode{mode},
			StorageClassName: ptr.To(c.Manifests.StorageClass.Name),
			Resources:        corev1.VolumeResourceRequirements{Requests: corev1.ResourceList{corev1.ResourceStorage: resource.MustParse("1Gi")}},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// CreatePod creates a pod name in ns, never restarted, whose one container
// sleeps for seconds with claim mounted at /data.
func (c *Cluster) CreatePod(ctx context.Context, t testing.TB, ns, name, claim string, seconds int) {
	t.Helper()
	if _, err := c.Guest.Kube.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns},
		Spec: corev1.PodSpec{
			RestartPolicy: corev1.RestartPolicyNever,
			Containers: []corev1.Container{{Name: "c", Image: "busybox", Command: []string{"sleep", strconv.Itoa(seconds)},
				VolumeMounts: []corev1.VolumeMount{{Name: "data", MountPath: "/data"}}}},
			Volumes: []corev1.Volume{{Name: "data", VolumeSource: corev1.VolumeSource{
				PersistentVolumeClaim: &corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim}}}},
		},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}

// unmountAllUnder lazily unmounts what the guest's kubelets left mounted
// under dir, deepest first, so that the directory can be removed.
func unmountAllUnder(t testing.TB, dir string) {
	data, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	var mps []string
	for _, l := range strings.Split(string(data), "\n") {
		if f := strings.Fields(l); len(f) > 4 && strings.HasPrefix(f[4], dir) {
			mps = append(mps, f[4])
		}
	}
	for i := len(mps) - 1; i >= 0; i-- {
		if out, err := exec.Command("umount", "-l", mps[i]).CombinedOutput(); err != nil {
			t.Logf("umount %s: %v %s", mps[i], err, out)
		}
	}
}

func logTails(t testing.TB, dir string) {
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		data, _ := os.ReadFile(filepath.Join(dir, e.Name()))
		t.Logf("---- %s (tail)\n%s", e.Name(), Tail(string(data), 40))
	}
}

// Tail is the last n lines of s: what a component did last is what explains
// a failure.
func Tail(s string, n int) string {
	lines := strings.Split(s, "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
