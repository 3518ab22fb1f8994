package testenv

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	authnv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/harvester-csi/harvester-csi-driver/internal/testwait"
)

func TestStartServesTheAPI(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	env, err := Start(ctx, Options{Namespace: "guests"})
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop()
	kube := kubernetes.NewForConfigOrDie(env.Config)
	if _, err := kube.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{}); err != nil {
		t.Fatalf("get default namespace: %v", err)
	}
	// The kubeconfig file reaches the same server with the same rights and
	// carries the namespace, as a host kubeconfig does.
	loader := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(&clientcmd.ClientConfigLoadingRules{ExplicitPath: env.Kubeconfig}, nil)
	ns, _, err := loader.Namespace()
	if err != nil || ns != "guests" {
		t.Fatalf("kubeconfig namespace = %q, %v; want guests", ns, err)
	}
	cfg, err := loader.ClientConfig()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kubernetes.NewForConfigOrDie(cfg).CoreV1().Namespaces().Create(ctx, nsObj("guests"), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create namespace through the kubeconfig: %v", err)
	}
}

func nsObj(name string) *corev1.Namespace {
	return &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name}}
}

// KubeVirt's control plane needs what a real cluster has and the default
// environment leaves out: every namespace's default ServiceAccount, pods with
// the projected token volume, the aggregation configuration extension API
// servers read, and service-account identities.
func TestStartWithServiceAccountsAggregationAndUsers(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	sa := ServiceAccountUser("kubevirt", "kubevirt-handler")
	env, err := Start(ctx, Options{ServiceAccounts: true, Aggregation: true, Users: []User{sa}})
	if err != nil {
		t.Fatal(err)
	}
	defer env.Stop()
	kube := kubernetes.NewForConfigOrDie(env.Config)

	if _, err := kube.CoreV1().Namespaces().Create(ctx, nsObj("guests"), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Until(ctx, t, "the default ServiceAccount of a new namespace", func() (bool, string) {
		_, err := kube.CoreV1().ServiceAccounts("guests").Get(ctx, "default", metav1.GetOptions{})
		return err == nil, fmt.Sprint(err)
	})
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: "p"},
		Spec:       corev1.PodSpec{Containers: []corev1.Container{{Name: "c", Image: "none"}}},
	}
	got, err := kube.CoreV1().Pods("guests").Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !hasProjectedToken(got) {
		t.Errorf("pod volumes %+v: want the projected service-account token volume admission adds", got.Spec.Volumes)
	}

	cm, err := kube.CoreV1().ConfigMaps("kube-system").Get(ctx, "extension-apiserver-authentication", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if cm.Data["requestheader-client-ca-file"] == "" || !strings.Contains(cm.Data["requestheader-allowed-names"], "front-proxy-client") {
		t.Errorf("extension-apiserver-authentication lacks the request-header configuration: %v", cm.Data)
	}

	cfg, err := env.UserConfig(sa.Name)
	if err != nil {
		t.Fatal(err)
	}
	review, err := kubernetes.NewForConfigOrDie(cfg).AuthenticationV1().SelfSubjectReviews().Create(ctx, &authnv1.SelfSubjectReview{}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if u := review.Status.UserInfo; u.Username != sa.Name || !slices.Contains(u.Groups, "system:serviceaccounts:kubevirt") {
		t.Errorf("user config authenticates as %s %v, want %s in its service-account groups", u.Username, u.Groups, sa.Name)
	}
	if _, err := env.UserConfig("nobody"); err == nil {
		t.Error("UserConfig of an unknown user: want an error")
	}
}

func hasProjectedToken(p *corev1.Pod) bool {
	for _, v := range p.Spec.Volumes {
		if v.Projected == nil {
			continue
		}
		for _, s := range v.Projected.Sources {
			if s.ServiceAccountToken != nil {
				return true
			}
		}
	}
	return false
}
