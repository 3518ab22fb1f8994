package kubevirtsim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"

	"golang.org/x/time/rate"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/yaml"
	kubevirtv1 "kubevirt.io/api/core/v1"
)

var (
	vmResource  = kubevirtv1.Resource("virtualmachine")
	vmiResource = kubevirtv1.Resource("virtualmachineinstance")
)

const vmiNotRunning = "VMI is not running"

// requestTimeout is the API server's timeout of a non-long-running request
// (--request-timeout, 60 s by default, k8s.io/apiserver pkg/server/config.go),
// which the aggregator's proxy to virt-api is subject to.
const requestTimeout = 60 * time.Second

// virtAPI is virt-api's addvolume/removevolume handler (v1.7.0
// pkg/virt-api/rest/volumes.go, v1.5.3 pkg/virt-api/rest/subresource.go);
// the front proxy routes the subresource paths to it. It keeps no volume
// state: virt-api has no per-VM lock or queue, only compare-and-swap
// patches.
//
// Two things make it slow under churn, as the real one is. Its client to
// the API server has the version's token bucket (features.virtAPIQPS), one
// for every caller: the lab's host has one API server, whose aggregator
// holds one HTTP/2 connection to virt-api, so one replica serves the
// driver's calls and the VM controller's alike. And its handlers read and
// patch with context.Background() (v1.5.3 subresource.go:297,408,427;
// v1.6.3 volumes.go:202,240,270): a caller that gives up, or the API
// server's request timeout, does not stop a request virt-api is still
// waiting to spend its budget on; the patch lands later.
type virtAPI struct {
	c       *cluster
	limit   *rate.Limiter
	timeout time.Duration
	// life is the simulator's run context, the only thing that stops a
	// request once virt-api has it; set by Start.
	life context.Context
}

func newVirtAPI(c *cluster) *virtAPI {
	return &virtAPI{
		c:       c,
		limit:   rate.NewLimiter(rate.Limit(c.feat.virtAPIQPS/c.opts.Scale), c.feat.virtAPIBurst),
		timeout: time.Duration(float64(requestTimeout) * c.opts.Scale),
		life:    context.Background(),
	}
}

// do runs one volume request the way virt-api and the API server in front
// of it do: the request runs on virt-api's own context to its end, while
// the caller gets the API server's 504 once the request timeout passes (or
// nothing, having left).
func (a *virtAPI) do(ctx context.Context, run func(context.Context) *apierrors.StatusError) *apierrors.StatusError {
	res := make(chan *apierrors.StatusError, 1)
	a.c.goRun(func() { res <- run(a.life) })
	t := time.NewTimer(a.timeout)
	defer t.Stop()
	select {
	case serr := <-res:
		return serr
	case <-t.C:
	case <-ctx.Done():
	}
	return apierrors.NewTimeoutError("request did not complete within the allotted timeout", 0)
}

// spend takes one request from virt-api's client budget, waiting as
// client-go's token bucket does.
func (a *virtAPI) spend(ctx context.Context) error {
	if err := a.limit.Wait(ctx); err != nil {
		return fmt.Errorf("client rate limiter Wait returned an error: %w", err)
	}
	return nil
}

// serve runs the checks in virt-api's order with its codes and messages:
// feature gate, decoding, fields, the live GET, the owned-VMI and
// not-running checks of the VMI path, the spec checks (verifyVolumeOption),
// the request-list checks of the legacy path, then the patch.
func (a *virtAPI) serve(w http.ResponseWriter, r *http.Request, info reqInfo) {
	add := info.key.Subresource == "addvolume"
	onVMI := info.key.Resource == resVMIs
	ns, name := info.namespace, info.name
	log := a.c.log.WithValues("vm", ns+"/"+name, "path", info.key.Resource+"/"+info.key.Subresource)

	// 1. feature gate
	legacy, declarative := a.c.gates()
	if !legacy && !declarative {
		msg := "Enable DeclarativeHotplugVolumes or HotplugVolumes feature gate to use this API."
		if a.c.feat.v15Messages {
			if add {
				msg = "Unable to Add Volume because HotplugVolumes feature gate is not enabled."
			} else {
				msg = "Unable to Remove Volume because HotplugVolumes feature gate is not enabled."
			}
		}
		writeStatus(w, apierrors.NewBadRequest(msg))
		return
	}

	// 3. decode, 4. fields
	var req kubevirtv1.VirtualMachineVolumeRequest
	dec := yaml.NewYAMLOrJSONDecoder(r.Body, 1024)
	if add {
		opts := &kubevirtv1.AddVolumeOptions{}
		if err := dec.Decode(opts); err != nil {
			writeStatus(w, apierrors.NewBadRequest(fmt.Sprintf("Can not unmarshal Request body to struct, error: %v", err)))
			return
		}
		switch {
		case opts.Name == "":
			writeStatus(w, apierrors.NewBadRequest("AddVolumeOptions requires name to be set"))
			return
		case opts.Disk == nil:
			writeStatus(w, apierrors.NewBadRequest("AddVolumeOptions requires disk to not be nil"))
			return
		case opts.VolumeSource == nil:
			writeStatus(w, apierrors.NewBadRequest("AddVolumeOptions requires VolumeSource to not be nil"))
			return
		}
		opts.Disk.Name = opts.Name
		if opts.VolumeSource.DataVolume != nil {
			opts.VolumeSource.DataVolume.Hotpluggable = true
		} else if opts.VolumeSource.PersistentVolumeClaim != nil {
			opts.VolumeSource.PersistentVolumeClaim.Hotpluggable = true
		}
		req.AddVolumeOptions = opts
	} else {
		opts := &kubevirtv1.RemoveVolumeOptions{}
		if err := dec.Decode(opts); err != nil {
			writeStatus(w, apierrors.NewBadRequest(fmt.Sprintf("Can not unmarshal Request body to struct, error: %v", err)))
			return
		}
		if opts.Name == "" {
			writeStatus(w, apierrors.NewBadRequest("RemoveVolumeOptions requires name to be set"))
			return
		}
		req.RemoveVolumeOptions = opts
	}
	log = log.WithValues("volume", requestName(&req))

	serr := a.do(r.Context(), func(ctx context.Context) *apierrors.StatusError {
		sleepCtx(ctx, a.c.jit.d(a.c.t.API))
		switch {
		case onVMI:
			return a.vmiVolumePatch(ctx, ns, name, &req, legacy)
		case legacy:
			return a.vmVolumePatchStatus(ctx, ns, name, &req)
		default:
			return a.vmVolumePatch(ctx, ns, name, &req)
		}
	})
	if serr != nil {
		log.V(2).Info("volume request rejected", "code", serr.Status().Code, "message", serr.Status().Message)
		writeStatus(w, serr)
		return
	}
	log.V(2).Info("volume request accepted", "dryRun", dryRunOf(&req))
	w.WriteHeader(http.StatusAccepted)
}

func requestName(req *kubevirtv1.VirtualMachineVolumeRequest) string {
	if req.AddVolumeOptions != nil {
		return req.AddVolumeOptions.Name
	}
	if req.RemoveVolumeOptions != nil {
		return req.RemoveVolumeOptions.Name
	}
	return ""
}

// dryRunOf honours dryRun only when its first element is "All".
func dryRunOf(req *kubevirtv1.VirtualMachineVolumeRequest) []string {
	var d []string
	if o := req.AddVolumeOptions; o != nil {
		d = o.DryRun
	} else if o := req.RemoveVolumeOptions; o != nil {
		d = o.DryRun
	}
	if len(d) > 0 && d[0] == metav1.DryRunAll {
		return d
	}
	return nil
}

func sleepCtx(ctx context.Context, d time.Duration) {
	if d <= 0 {
		return
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

func (a *virtAPI) fetchVM(ctx context.Context, ns, name string) (*kubevirtv1.VirtualMachine, *apierrors.StatusError) {
	vm := &kubevirtv1.VirtualMachine{}
	if err := a.spend(ctx); err != nil {
		return nil, apierrors.NewInternalError(fmt.Errorf("unable to retrieve vm [%s]: %v", name, err))
	}
	if err := a.c.kv.get(ctx, resVMs, ns, name, vm); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, apierrors.NewNotFound(vmResource, name)
		}
		return nil, apierrors.NewInternalError(fmt.Errorf("unable to retrieve vm [%s]: %v", name, err))
	}
	return vm, nil
}

func (a *virtAPI) fetchVMI(ctx context.Context, ns, name string) (*kubevirtv1.VirtualMachineInstance, *apierrors.StatusError) {
	vmi := &kubevirtv1.VirtualMachineInstance{}
	if err := a.spend(ctx); err != nil {
		return nil, apierrors.NewInternalError(fmt.Errorf("unable to retrieve vmi [%s]: %v", name, err))
	}
	if err := a.c.kv.get(ctx, resVMIs, ns, name, vmi); err != nil {
		if apierrors.IsNotFound(err) {
			return nil, apierrors.NewNotFound(vmiResource, name)
		}
		return nil, apierrors.NewInternalError(fmt.Errorf("unable to retrieve vmi [%s]: %v", name, err))
	}
	return vmi, nil
}

// vmVolumePatchStatus is the legacy VM path: queue the request in
// vm.status.volumeRequests with a compare-and-swap of the whole list.
func (a *virtAPI) vmVolumePatchStatus(ctx context.Context, ns, name string, req *kubevirtv1.VirtualMachineVolumeRequest) *apierrors.StatusError {
	vm, serr := a.fetchVM(ctx, ns, name)
	if serr != nil {
		return serr
	}
	if err := verifyVolumeOption(vm.Spec.Template.Spec.Volumes, req); err != nil {
		return apierrors.NewConflict(vmResource, name, err)
	}
	newList, err := queueVolumeRequest(vm.Status.VolumeRequests, req)
	if err != nil {
		return apierrors.NewConflict(vmResource, name, err)
	}
	patch, err := casPatch(casOp{"/status/volumeRequests", vm.Status.VolumeRequests, newList, len(vm.Status.VolumeRequests) > 0})
	if err != nil {
		return apierrors.NewInternalError(err)
	}
	sleepCtx(ctx, a.c.jit.d(a.c.t.RaceWindow))
	if err := a.spend(ctx); err != nil {
		return apierrors.NewInternalError(err)
	}
	if err := a.c.kv.patch(ctx, resVMs, ns, name, "status", types.JSONPatchType, patch, dryRunOf(req), &kubevirtv1.VirtualMachine{}); err != nil {
		return passInvalid(err, "unable to patch vm status")
	}
	return nil
}

// vmVolumePatch is the declarative VM path: test-and-replace the template's
// volumes and disks.
func (a *virtAPI) vmVolumePatch(ctx context.Context, ns, name string, req *kubevirtv1.VirtualMachineVolumeRequest) *apierrors.StatusError {
	vm, serr := a.fetchVM(ctx, ns, name)
	if serr != nil {
		return serr
	}
	if err := verifyVolumeOption(vm.Spec.Template.Spec.Volumes, req); err != nil {
		return apierrors.NewConflict(vmResource, name, err)
	}
	patch, err := specPatch("/spec/template", &vm.Spec.Template.Spec, req)
	if err != nil {
		return apierrors.NewConflict(vmResource, name, err)
	}
	sleepCtx(ctx, a.c.jit.d(a.c.t.RaceWindow))
	if err := a.spend(ctx); err != nil {
		return apierrors.NewInternalError(err)
	}
	if err := a.c.kv.patch(ctx, resVMs, ns, name, "", types.JSONPatchType, patch, dryRunOf(req), &kubevirtv1.VirtualMachine{}); err != nil {
		return passInvalid(err, "unable to patch vm")
	}
	return nil
}

// vmiVolumePatch is the VMI path, used by clients and by the legacy VM
// controller.
func (a *virtAPI) vmiVolumePatch(ctx context.Context, ns, name string, req *kubevirtv1.VirtualMachineVolumeRequest, legacy bool) *apierrors.StatusError {
	vmi, serr := a.fetchVMI(ctx, ns, name)
	if serr != nil {
		return serr
	}
	if a.c.feat.ownedVMICheck && !legacy && ownedByVM(vmi) {
		return apierrors.NewBadRequest(fmt.Sprintf("VMI %s/%s is owned by a VM", vmi.Namespace, vmi.Name))
	}
	if vmi.Status.Phase != kubevirtv1.Running {
		return apierrors.NewConflict(vmiResource, name, errors.New(vmiNotRunning))
	}
	if err := verifyVolumeOption(vmi.Spec.Volumes, req); err != nil {
		return apierrors.NewConflict(vmiResource, name, err)
	}
	patch, err := specPatch("", &vmi.Spec, req)
	if err != nil {
		return apierrors.NewConflict(vmiResource, name, err)
	}
	sleepCtx(ctx, a.c.jit.d(a.c.t.RaceWindow))
	if err := a.spend(ctx); err != nil {
		return apierrors.NewInternalError(err)
	}
	if err := a.c.kv.patch(ctx, resVMIs, ns, name, "", types.JSONPatchType, patch, dryRunOf(req), &kubevirtv1.VirtualMachineInstance{}); err != nil {
		return passInvalid(err, "unable to patch vmi")
	}
	return nil
}

func ownedByVM(vmi *kubevirtv1.VirtualMachineInstance) bool {
	for _, o := range vmi.OwnerReferences {
		if o.Kind == "VirtualMachine" && o.Controller != nil && *o.Controller {
			return true
		}
	}
	return false
}

// passInvalid returns 422s (failed JSON-patch tests, webhook denials) as they
// are and wraps anything else in a 500, as virt-api does.
func passInvalid(err error, what string) *apierrors.StatusError {
	var se *apierrors.StatusError
	if apierrors.IsInvalid(err) && errors.As(err, &se) {
		return se
	}
	return apierrors.NewInternalError(fmt.Errorf("%s: %v", what, err))
}

// verifyVolumeOption checks a request against a list of volumes (the VM
// template's or the VMI's); it never looks at volumeRequests or volumeStatus.
func verifyVolumeOption(volumes []kubevirtv1.Volume, req *kubevirtv1.VirtualMachineVolumeRequest) error {
	foundRemove := false
	for _, v := range volumes {
		if o := req.AddVolumeOptions; o != nil {
			src := hotplugSourceName(o.VolumeSource)
			if v.Name == o.Name {
				return fmt.Errorf("Unable to add volume [%s] because volume with that name already exists", o.Name)
			}
			if volumeClaim(v) != "" && volumeClaim(v) == src {
				return fmt.Errorf("Unable to add volume source [%s] because it already exists", src)
			}
		} else if o := req.RemoveVolumeOptions; o != nil && (v.Name == o.Name || (volumeClaim(v) != "" && volumeClaim(v) == o.Name)) {
			if !isHotpluggable(v) {
				return fmt.Errorf("Unable to remove volume [%s] because it is not hotpluggable", v.Name)
			}
			foundRemove = true
			break
		}
	}
	if o := req.RemoveVolumeOptions; o != nil && !foundRemove {
		return fmt.Errorf("Unable to remove volume [%s] because it does not exist", o.Name)
	}
	return nil
}

// queueVolumeRequest scans the queued requests and returns the new list: an
// add is appended, a remove replaces a queued add of the same name.
func queueVolumeRequest(list []kubevirtv1.VirtualMachineVolumeRequest, req *kubevirtv1.VirtualMachineVolumeRequest) ([]kubevirtv1.VirtualMachineVolumeRequest, error) {
	if o := req.AddVolumeOptions; o != nil {
		for _, q := range list {
			if q.AddVolumeOptions != nil && q.AddVolumeOptions.Name == o.Name {
				return nil, fmt.Errorf("add volume request for volume [%s] already exists", o.Name)
			}
			if q.RemoveVolumeOptions != nil && q.RemoveVolumeOptions.Name == o.Name {
				return nil, fmt.Errorf("unable to add volume since a remove volume request for volume [%s] already exists and is still being processed", o.Name)
			}
		}
		out := append(append([]kubevirtv1.VirtualMachineVolumeRequest{}, list...), *stripDryRun(req))
		return out, nil
	}
	name := req.RemoveVolumeOptions.Name
	var out []kubevirtv1.VirtualMachineVolumeRequest
	for _, q := range list {
		if q.AddVolumeOptions != nil && q.AddVolumeOptions.Name == name {
			continue
		}
		if q.RemoveVolumeOptions != nil && q.RemoveVolumeOptions.Name == name {
			return nil, fmt.Errorf("a remove volume request for volume [%s] already exists and is still being processed", name)
		}
		out = append(out, q)
	}
	return append(out, *stripDryRun(req)), nil
}

func stripDryRun(req *kubevirtv1.VirtualMachineVolumeRequest) *kubevirtv1.VirtualMachineVolumeRequest {
	c := req.DeepCopy()
	if c.AddVolumeOptions != nil {
		c.AddVolumeOptions.DryRun = nil
	}
	if c.RemoveVolumeOptions != nil {
		c.RemoveVolumeOptions.DryRun = nil
	}
	return c
}

// applyVolumeRequest applies a request to a VMI spec (the VM template or the
// VMI): an add appends a hotpluggable volume and its disk unless a volume of
// that name exists; a remove drops every volume and disk with that name.
func applyVolumeRequest(spec *kubevirtv1.VirtualMachineInstanceSpec, req *kubevirtv1.VirtualMachineVolumeRequest) {
	if o := req.AddVolumeOptions; o != nil {
		for _, v := range spec.Volumes {
			if v.Name == o.Name {
				return
			}
		}
		nv := kubevirtv1.Volume{Name: o.Name}
		if o.VolumeSource != nil {
			if o.VolumeSource.PersistentVolumeClaim != nil {
				pvc := o.VolumeSource.PersistentVolumeClaim.DeepCopy()
				pvc.Hotpluggable = true
				nv.PersistentVolumeClaim = pvc
			} else if o.VolumeSource.DataVolume != nil {
				dv := o.VolumeSource.DataVolume.DeepCopy()
				dv.Hotpluggable = true
				nv.DataVolume = dv
			}
		}
		spec.Volumes = append(spec.Volumes, nv)
		if o.Disk != nil {
			d := o.Disk.DeepCopy()
			d.Name = o.Name
			spec.Domain.Devices.Disks = append(spec.Domain.Devices.Disks, *d)
		}
		return
	}
	if o := req.RemoveVolumeOptions; o != nil {
		vols := []kubevirtv1.Volume{}
		for _, v := range spec.Volumes {
			if v.Name != o.Name {
				vols = append(vols, v)
			}
		}
		disks := []kubevirtv1.Disk{}
		for _, d := range spec.Domain.Devices.Disks {
			if d.Name != o.Name {
				disks = append(disks, d)
			}
		}
		spec.Volumes, spec.Domain.Devices.Disks = vols, disks
	}
}

// specPatch builds virt-api's test-and-replace patch on the volumes and disks
// under prefix ("/spec/template" for a VM, "" for a VMI).
func specPatch(prefix string, spec *kubevirtv1.VirtualMachineInstanceSpec, req *kubevirtv1.VirtualMachineVolumeRequest) ([]byte, error) {
	next := spec.DeepCopy()
	applyVolumeRequest(next, req)
	return casPatch(
		casOp{prefix + "/spec/volumes", spec.Volumes, next.Volumes, len(spec.Volumes) > 0},
		casOp{prefix + "/spec/domain/devices/disks", spec.Domain.Devices.Disks, next.Domain.Devices.Disks, len(spec.Domain.Devices.Disks) > 0},
	)
}

// casOp is one guarded list write: test the old value, then replace it (or
// add it when the old list was empty).
type casOp struct {
	path     string
	old, new any
	replace  bool
}

func casPatch(ops ...casOp) ([]byte, error) {
	type op struct {
		Op    string `json:"op"`
		Path  string `json:"path"`
		Value any    `json:"value"`
	}
	var out []op
	for _, o := range ops {
		out = append(out, op{"test", o.path, o.old})
	}
	for _, o := range ops {
		verb := "add"
		if o.replace {
			verb = "replace"
		}
		out = append(out, op{verb, o.path, o.new})
	}
	return json.Marshal(out)
}

func hotplugSourceName(src *kubevirtv1.HotplugVolumeSource) string {
	if src == nil {
		return ""
	}
	if src.DataVolume != nil {
		return src.DataVolume.Name
	}
	if src.PersistentVolumeClaim != nil {
		return src.PersistentVolumeClaim.ClaimName
	}
	return ""
}

// volumeClaim is the claim (or DataVolume, same name) behind a volume.
func volumeClaim(v kubevirtv1.Volume) string {
	if v.PersistentVolumeClaim != nil {
		return v.PersistentVolumeClaim.ClaimName
	}
	if v.DataVolume != nil {
		return v.DataVolume.Name
	}
	return ""
}

func isHotpluggable(v kubevirtv1.Volume) bool {
	return (v.PersistentVolumeClaim != nil && v.PersistentVolumeClaim.Hotpluggable) ||
		(v.DataVolume != nil && v.DataVolume.Hotpluggable)
}
