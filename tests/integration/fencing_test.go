package integration

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/harvester-csi/harvester-csi-driver/internal/kubevirtsim"
	"github.com/harvester-csi/harvester-csi-driver/tests/framework"
)

// fencingUnderLag drives random publishes and unpublishes of two RWO volumes
// to two VMs from several callers at once, with timeouts of every length,
// while the controller's informers run well behind the API server and the
// controller is killed and restarted now and then. At no moment may a volume
// be in two VMs' specs, legacy request lists or VMIs (read straight from the
// API server), and a publish answered OK must hold on its VM alone.
func (s *suite) fencingUnderLag(t *testing.T) {
	vms := []string{"fl-a", "fl-b"}
	vols := s.scene(t, "fl", 2, vms...)
	opts := framework.ControllerOptions{Backend: s.f.backendFlag(), Queue: queueConfig(), InformerLag: 300 * time.Millisecond}
	var mu sync.Mutex
	ctrl := s.host.StartController(t, opts)
	client := func() csi.ControllerClient { mu.Lock(); defer mu.Unlock(); return ctrl.Client }

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	stop := make(chan struct{})
	var violations []string
	var vmu sync.Mutex
	violate := func(format string, args ...any) {
		vmu.Lock()
		defer vmu.Unlock()
		if len(violations) < 20 {
			violations = append(violations, fmt.Sprintf(format, args...))
		}
	}

	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // the monitor: never two holders
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			for vol, holders := range s.liveHolders(ctx, vols) {
				if len(holders) > 1 {
					violate("%s held by %v at once", vol, holders)
				}
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()

	var published, refused, restarts int
	var cmu sync.Mutex
	for actor := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(actor), 42))
			for {
				select {
				case <-stop:
					return
				default:
				}
				vol, vm := vols[rng.IntN(len(vols))], vms[rng.IntN(len(vms))]
				timeout := time.Duration(50+rng.IntN(2000)) * time.Millisecond
				cctx, c := context.WithTimeout(ctx, timeout)
				var err error
				if rng.IntN(2) == 0 {
					_, err = client().ControllerPublishVolume(cctx, publishReq(vm, vol))
					switch status.Code(err) {
					case codes.OK:
						if h := s.liveHolders(ctx, []string{vol})[vol]; !slices.Equal(h, []string{vm}) {
							violate("publish of %s to %s answered OK while held by %v", vol, vm, h)
						}
						cmu.Lock()
						published++
						cmu.Unlock()
					case codes.FailedPrecondition:
						cmu.Lock()
						refused++
						cmu.Unlock()
					}
				} else {
					_, err = client().ControllerUnpublishVolume(cctx, &csi.ControllerUnpublishVolumeRequest{VolumeId: vol, NodeId: vm})
				}
				c()
			}
		}()
	}
	wg.Add(1)
	go func() { // kill and restart the controller now and then
		defer wg.Done()
		rng := rand.New(rand.NewPCG(7, 7))
		for {
			select {
			case <-stop:
				return
			case <-time.After(time.Duration(1000+rng.IntN(2000)) * time.Millisecond):
			}
			mu.Lock()
			old := ctrl
			mu.Unlock()
			old.Stop()
			next := s.host.StartController(t, opts)
			mu.Lock()
			ctrl = next
			mu.Unlock()
			cmu.Lock()
			restarts++
			cmu.Unlock()
		}
	}()
	time.Sleep(20 * time.Second)
	close(stop)
	wg.Wait()

	// Let everything go, as the attacher eventually does, and check nothing
	// is left behind.
	a := newAttacher(client)
	for _, vol := range vols {
		for _, vm := range vms {
			if err := a.unpublish(ctx, vm, vol); err != nil {
				t.Errorf("final unpublish of %s from %s: %v", vol, vm, err)
			}
		}
	}
	for vol, h := range s.liveHolders(ctx, vols) {
		if len(h) > 0 {
			t.Errorf("%s still held by %v after every unpublish answered OK", vol, h)
		}
	}
	for _, v := range violations {
		t.Error(v)
	}
	t.Logf("%d publishes answered OK, %d refused as held elsewhere, %d restarts", published, refused, restarts)
	if published == 0 || refused == 0 || restarts == 0 {
		t.Errorf("the run did not exercise fencing (published %d, refused %d, restarts %d)", published, refused, restarts)
	}
}

// liveHolders reads from the API server which VMs hold each volume in their
// spec, legacy request list, VMI spec or VMI volume status.
func (s *suite) liveHolders(ctx context.Context, vols []string) map[string][]string {
	out := map[string][]string{}
	vmList, err := s.kv.KubevirtV1().VirtualMachines(s.host.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return out
	}
	vmiList, err := s.kv.KubevirtV1().VirtualMachineInstances(s.host.Namespace).List(ctx, metav1.ListOptions{})
	if err != nil {
		return out
	}
	hold := func(vol, vm string) {
		if !slices.Contains(out[vol], vm) {
			out[vol] = append(out[vol], vm)
			slices.Sort(out[vol])
		}
	}
	for _, vol := range vols {
		out[vol] = nil
		for _, vm := range vmList.Items {
			if vm.Spec.Template != nil && kubevirtsim.HasVolume(vm.Spec.Template.Spec.Volumes, vol) {
				hold(vol, vm.Name)
			}
			for _, r := range vm.Status.VolumeRequests {
				if r.AddVolumeOptions != nil && r.AddVolumeOptions.Name == vol {
					hold(vol, vm.Name)
				}
			}
		}
		for _, vmi := range vmiList.Items {
			if kubevirtsim.HasVolume(vmi.Spec.Volumes, vol) {
				hold(vol, vmi.Name)
			}
			for _, st := range vmi.Status.VolumeStatus {
				if st.Name == vol {
					hold(vol, vmi.Name)
				}
			}
		}
	}
	return out
}
