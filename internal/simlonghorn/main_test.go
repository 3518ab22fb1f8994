package simlonghorn

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// One API server for the package; every test runs its own stand-in on its
// own namespace. The host nodes are shared and never changed.
var (
	env   *testenv.Env
	nsSeq atomic.Int64
)

var hostNodes = []string{"host-a", "host-b"}

// testScale runs Longhorn 20 times faster than real: attach 0.5 s, the
// publish timeout 4.5 s, its poll 0.1 s.
const testScale = 0.05

func TestMain(m *testing.M) {
	klog.InitFlags(nil)
	flag.Parse()
	if testing.Short() {
		os.Exit(m.Run())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	err := start(ctx)
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "simlonghorn tests:", err)
		if env != nil {
			env.Stop()
		}
		os.Exit(1)
	}
	code := m.Run()
	env.Stop()
	os.Exit(code)
}

func start(ctx context.Context) error {
	var err error
	if env, err = testenv.Start(ctx, testenv.Options{}); err != nil {
		return fmt.Errorf("cannot start the API server: %w", err)
	}
	if err := InstallCRDs(ctx, env.Config); err != nil {
		return err
	}
	kube, err := kubernetes.NewForConfig(env.Config)
	if err != nil {
		return err
	}
	for _, n := range hostNodes {
		if _, err := kube.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: n}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return err
		}
	}
	return nil
}

// lab is one test's stand-in with a CSI connection per host node (each
// serving the controller too, as the plugin pod on every node does).
type lab struct {
	sim  *Sim
	kube kubernetes.Interface
	ns   string
	ctrl csi.ControllerClient
	node map[string]csi.NodeClient
}

func newLab(t *testing.T, opts Options) *lab {
	t.Helper()
	if env == nil {
		t.Skip("needs the API server (not in -short mode)")
	}
	return newLabWith(t, opts, env.Config)
}

// newLabWith runs the stand-in on cfg (the tests' client stays the
// admin's).
func newLabWith(t *testing.T, opts Options, cfg *rest.Config) *lab {
	t.Helper()
	if env == nil {
		t.Skip("needs the API server (not in -short mode)")
	}
	ns := strings.ToLower(strings.NewReplacer("/", "-", "_", "-").Replace(t.Name()))
	if len(ns) > 50 {
		ns = ns[:50]
	}
	ns = fmt.Sprintf("%s-%d", strings.Trim(ns, "-"), nsSeq.Add(1))
	kube, err := kubernetes.NewForConfig(env.Config)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if _, err := kube.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	opts.Namespace = ns
	if opts.Scale == 0 {
		opts.Scale = testScale
	}
	opts.Jitter = 0.2
	sim, err := New(cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		cancel()
		wg.Wait()
	})
	wg.Add(1)
	go func() { defer wg.Done(); sim.Run(ctx) }()
	dir, err := os.MkdirTemp("", "lh")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	l := &lab{sim: sim, kube: kube, ns: ns, node: map[string]csi.NodeClient{}}
	for _, n := range hostNodes {
		sock := dir + "/" + n + ".sock"
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := sim.Serve(ctx, sock, n); err != nil {
				t.Errorf("serve %s: %v", n, err)
			}
		}()
		conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = conn.Close() })
		l.node[n] = csi.NewNodeClient(conn)
		if l.ctrl == nil {
			l.ctrl = csi.NewControllerClient(conn)
		}
	}
	return l
}

func ctxFor(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func blockCap(mode csi.VolumeCapability_AccessMode_Mode) *csi.VolumeCapability {
	return &csi.VolumeCapability{
		AccessType: &csi.VolumeCapability_Block{Block: &csi.VolumeCapability_BlockVolume{}},
		AccessMode: &csi.VolumeCapability_AccessMode{Mode: mode},
	}
}

var rwo = blockCap(csi.VolumeCapability_AccessMode_SINGLE_NODE_WRITER)
var rwx = blockCap(csi.VolumeCapability_AccessMode_MULTI_NODE_MULTI_WRITER)

// publish calls ControllerPublishVolume as the external-attacher does.
func (l *lab) publish(ctx context.Context, vol, node string, vc *csi.VolumeCapability) error {
	_, err := l.ctrl.ControllerPublishVolume(ctx, &csi.ControllerPublishVolumeRequest{VolumeId: vol, NodeId: node, VolumeCapability: vc})
	return err
}

func (l *lab) unpublish(ctx context.Context, vol, node string) error {
	_, err := l.ctrl.ControllerUnpublishVolume(ctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: node})
	return err
}

// nodePublish calls NodeStageVolume, then NodePublishVolume, as the
// kubelet does.
func (l *lab) nodePublish(ctx context.Context, vol, node string) error {
	if _, err := l.node[node].NodeStageVolume(ctx, &csi.NodeStageVolumeRequest{
		VolumeId: vol, StagingTargetPath: "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/staging/" + vol,
		VolumeCapability: rwo,
	}); err != nil {
		return err
	}
	_, err := l.node[node].NodePublishVolume(ctx, &csi.NodePublishVolumeRequest{
		VolumeId: vol, TargetPath: "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/publish/" + vol,
		StagingTargetPath: "/var/lib/kubelet/plugins/kubernetes.io/csi/volumeDevices/staging/" + vol,
		VolumeCapability:  rwo,
	})
	return err
}

func (l *lab) createVolume(t *testing.T, spec NewVolume) {
	t.Helper()
	if spec.Size == 0 {
		spec.Size = 1 << 30
	}
	if err := l.sim.CreateVolume(ctxFor(t), spec); err != nil {
		t.Fatal(err)
	}
}

func (l *lab) volume(t *testing.T, name string) *Volume {
	t.Helper()
	v, err := l.sim.store.getVolume(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// recordVolume watches the volume from now on and returns every stored
// version of it, so a test can check what was ever written, not only what
// it sampled.
func (l *lab) recordVolume(t *testing.T, name string) func() []*Volume {
	t.Helper()
	w, err := l.sim.store.res(volumeGVR).Watch(ctxFor(t), metav1.ListOptions{FieldSelector: "metadata.name=" + name})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var seen []*Volume
	done := make(chan struct{})
	go func() {
		defer close(done)
		for ev := range w.ResultChan() {
			if ev.Type != watch.Added && ev.Type != watch.Modified {
				continue
			}
			v, err := fromU[Volume](asUnstructured(ev.Object))
			if err == nil {
				mu.Lock()
				seen = append(seen, v)
				mu.Unlock()
			}
		}
	}()
	t.Cleanup(func() { w.Stop(); <-done })
	return func() []*Volume {
		mu.Lock()
		defer mu.Unlock()
		return append([]*Volume(nil), seen...)
	}
}

func until(t *testing.T, what string, cond func() (bool, string)) {
	t.Helper()
	testwait.Until(ctxFor(t), t, what, cond)
}

func asUnstructured(o any) *unstructured.Unstructured {
	u, _ := o.(*unstructured.Unstructured)
	if u == nil {
		return &unstructured.Unstructured{Object: map[string]any{}}
	}
	return u
}
