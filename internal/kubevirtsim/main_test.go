package kubevirtsim

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	kubevirtv1 "kubevirt.io/api/core/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/testenv"
	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

// One API server for the whole package; every test runs its own simulator
// scoped to its own namespace (and its own KubeVirt CR there).
var (
	env   *testenv.Env
	nsSeq atomic.Int64
)

func TestMain(m *testing.M) {
	klog.InitFlags(nil)
	flag.Parse()
	// The tests mostly wait on simulated time: run more of them at once than
	// there are CPUs, unless -parallel was given.
	if f := flag.Lookup("test.parallel"); f != nil && f.Value.String() == strconv.Itoa(runtime.GOMAXPROCS(0)) {
		_ = f.Value.Set("6")
	}
	if testing.Short() {
		os.Exit(m.Run())
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	var err error
	env, err = testenv.Start(ctx, testenv.Options{})
	cancel()
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubevirtsim tests: cannot start the API server:", err)
		os.Exit(1)
	}
	code := m.Run()
	env.Stop()
	os.Exit(code)
}

// testSim starts a simulator for t in a fresh namespace named after the test.
func testSim(t *testing.T, opts Options) (*Sim, string) {
	t.Helper()
	if env == nil {
		t.Skip("needs the API server (not in -short mode)")
	}
	ns := strings.ToLower(strings.NewReplacer("/", "-", "_", "-", ".", "-").Replace(t.Name()))
	if len(ns) > 50 {
		ns = ns[:50]
	}
	ns = fmt.Sprintf("%s-%d", strings.Trim(ns, "-"), nsSeq.Add(1)) // unique under -count
	opts.Namespace = ns
	if opts.KubeVirtNamespace == "" {
		opts.KubeVirtNamespace = ns
	}
	if opts.ServerVersion == "" {
		opts.SkipServerVersion = true
	}
	if opts.Scale == 0 {
		opts.Scale = 0.05
	}
	s, err := New(env.Config, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := s.c.ensureNamespace(ctx, ns); err != nil {
		t.Fatal(err)
	}
	logger := klog.Background().WithValues("test", t.Name())
	if err := s.Start(klog.NewContext(context.Background(), logger)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s, ns
}

func testCtx(t *testing.T, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// answer is what the proxy answered to a subresource call.
type answer struct {
	code   int
	body   string
	status metav1.Status
}

func (a answer) String() string { return fmt.Sprintf("%d %s", a.code, a.body) }

// call PUTs body to a subresource through the front proxy as the admin.
func call(t *testing.T, s *Sim, ns, resource, name, sub string, body any) answer {
	t.Helper()
	var data []byte
	switch b := body.(type) {
	case string:
		data = []byte(b)
	case []byte:
		data = b
	default:
		var err error
		if data, err = json.Marshal(b); err != nil {
			t.Fatal(err)
		}
	}
	url := fmt.Sprintf("%s/apis/subresources.kubevirt.io/v1/namespaces/%s/%s/%s/%s", s.ProxyURL(), ns, resource, name, sub)
	req, _ := http.NewRequest(http.MethodPut, url, bytes.NewReader(data))
	req.Header.Set("Authorization", "Bearer "+env.Config.BearerToken)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	a := answer{code: resp.StatusCode, body: string(raw)}
	if len(raw) > 0 {
		_ = json.Unmarshal(raw, &a.status)
	}
	return a
}

func addOpts(name, claim, bus string) *kubevirtv1.AddVolumeOptions {
	return &kubevirtv1.AddVolumeOptions{
		Name: name,
		Disk: &kubevirtv1.Disk{DiskDevice: kubevirtv1.DiskDevice{Disk: &kubevirtv1.DiskTarget{Bus: kubevirtv1.DiskBus(bus)}}},
		VolumeSource: &kubevirtv1.HotplugVolumeSource{
			PersistentVolumeClaim: &kubevirtv1.PersistentVolumeClaimVolumeSource{
				PersistentVolumeClaimVolumeSource: corev1.PersistentVolumeClaimVolumeSource{ClaimName: claim},
			},
		},
	}
}

func addVolume(t *testing.T, s *Sim, ns, vm, name string) answer {
	t.Helper()
	return call(t, s, ns, resVMs, vm, "addvolume", addOpts(name, name, "scsi"))
}

func removeVolume(t *testing.T, s *Sim, ns, vm, name string) answer {
	t.Helper()
	return call(t, s, ns, resVMs, vm, "removevolume", &kubevirtv1.RemoveVolumeOptions{Name: name})
}

func expectAnswer(t *testing.T, got answer, code int, msg string) {
	t.Helper()
	if got.code != code || got.status.Message != msg {
		t.Errorf("got %d %q\nwant %d %q", got.code, got.status.Message, code, msg)
	}
}

func expect202(t *testing.T, got answer) {
	t.Helper()
	if got.code != http.StatusAccepted || got.body != "" {
		t.Fatalf("want 202 with an empty body, got %s", got)
	}
}

// proxyKV is a kubevirt.io client that goes through the front proxy, like a
// driver would.
func proxyKV(t *testing.T, s *Sim) *kvClient {
	t.Helper()
	c, err := newKVClient(s.ClientConfig())
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// patchVMVolumes adds (and removes) hotplug volumes in the VM template with
// one JSON patch guarded by tests on both lists, through the proxy.
func patchVMVolumes(ctx context.Context, t *testing.T, s *Sim, c *kvClient, ns, name string, add []string, remove []string) error {
	t.Helper()
	vm := &kubevirtv1.VirtualMachine{}
	if err := c.get(ctx, resVMs, ns, name, vm); err != nil {
		return err
	}
	spec := vm.Spec.Template.Spec.DeepCopy()
	for _, r := range remove {
		applyVolumeRequest(spec, &kubevirtv1.VirtualMachineVolumeRequest{RemoveVolumeOptions: &kubevirtv1.RemoveVolumeOptions{Name: r}})
	}
	for _, a := range add {
		applyVolumeRequest(spec, &kubevirtv1.VirtualMachineVolumeRequest{AddVolumeOptions: addOpts(a, a, "scsi")})
	}
	patch, err := casPatch(
		casOp{"/spec/template/spec/volumes", vm.Spec.Template.Spec.Volumes, spec.Volumes, len(vm.Spec.Template.Spec.Volumes) > 0},
		casOp{"/spec/template/spec/domain/devices/disks", vm.Spec.Template.Spec.Domain.Devices.Disks, spec.Domain.Devices.Disks, len(vm.Spec.Template.Spec.Domain.Devices.Disks) > 0},
	)
	if err != nil {
		t.Fatal(err)
	}
	return c.patch(ctx, resVMs, ns, name, "", types.JSONPatchType, patch, nil, &kubevirtv1.VirtualMachine{})
}

// phaseLog records every phase a volume's volumeStatus entry takes, from the
// VMI watch (each update event), with "-" when the entry disappears.
type phaseLog struct {
	mu     sync.Mutex
	phases map[string][]string
}

func recordPhases(s *Sim, ns, vm string) *phaseLog {
	l := &phaseLog{phases: map[string][]string{}}
	note := func(obj any) {
		vmi, ok := obj.(*kubevirtv1.VirtualMachineInstance)
		if !ok || vmi.Namespace != ns || vmi.Name != vm {
			return
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		seen := map[string]bool{}
		for _, e := range vmi.Status.VolumeStatus {
			if e.HotplugVolume == nil {
				continue
			}
			seen[e.Name] = true
			ps := l.phases[e.Name]
			if len(ps) == 0 || ps[len(ps)-1] != string(e.Phase) {
				l.phases[e.Name] = append(ps, string(e.Phase))
			}
		}
		for name, ps := range l.phases {
			if !seen[name] && ps[len(ps)-1] != "-" {
				l.phases[name] = append(ps, "-")
			}
		}
	}
	_, _ = s.c.vmiInf.AddEventHandler(cacheHandler(note))
	return l
}

// waitFor waits (a little) for the log of volume to equal want, since the
// recorder's handler may run after the handler a Wait returned on.
// Detaching is left out of the comparison: KubeVirt deletes the attachment
// pod with grace period 0 in the pass that writes Detaching, so the entry
// shows it for one pass at most, and not at all when that write loses a
// race and the retry finds the pod gone.
func (l *phaseLog) waitFor(t *testing.T, volume string, want []string, d time.Duration) {
	t.Helper()
	notDetaching := func(p string) bool { return p == string(kubevirtv1.HotplugVolumeDetaching) }
	// Without Detaching, virt-handler's Ready written back over it while the
	// domain still has the disk (v1.5.3: every entry with a target is Ready,
	// pkg/virt-handler/vm.go updateHotplugVolumeStatus) repeats the phase
	// before: one Ready or two, by who wins the race.
	want = slices.Compact(slices.DeleteFunc(slices.Clone(want), notDetaching))
	testwait.For(t, fmt.Sprintf("%s phases %v", volume, want), d, func() bool {
		return slices.Equal(slices.Compact(slices.DeleteFunc(l.get(volume), notDetaching)), want)
	})
}

func (l *phaseLog) get(volume string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string{}, l.phases[volume]...)
}

// vmWithClaims creates a 1Gi claim per name in claims and then the running
// VM vm in ns, where most hotplug scenarios start.
func vmWithClaims(ctx context.Context, t *testing.T, s *Sim, ns, vm string, claims ...string) {
	t.Helper()
	for _, c := range claims {
		if _, err := s.CreatePVC(ctx, ns, c, "1Gi", false); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.CreateVM(ctx, VMSpec{Namespace: ns, Name: vm}); err != nil {
		t.Fatal(err)
	}
}

func ready(t *testing.T, s *Sim, ns, vm, volume string, d time.Duration) string {
	t.Helper()
	target, err := s.WaitVolumeReady(testCtx(t, d), ns, vm, volume)
	if err != nil {
		_, vmi := s.VM(ns, vm)
		e, _ := FindVolumeStatus(vmi, volume)
		t.Fatalf("volume %s not ready: %v (entry %+v)", volume, err, e)
	}
	return target
}

func detached(t *testing.T, s *Sim, ns, vm, volume string, d time.Duration) {
	t.Helper()
	if err := s.WaitVolumeDetached(testCtx(t, d), ns, vm, volume); err != nil {
		_, vmi := s.VM(ns, vm)
		e, _ := FindVolumeStatus(vmi, volume)
		t.Fatalf("volume %s not detached: %v (entry %+v)", volume, err, e)
	}
}
