package testenv

import (
	"encoding/json"
	"io"
	"net/http"

	admissionv1 "k8s.io/api/admission/v1"
)

// AdmissionHandler serves a webhook the API server calls: it decodes the
// AdmissionReview, asks decide for the response and answers with it under
// the request's UID and the review's own apiVersion/kind, as the API server
// requires. A body that is no AdmissionReview with a request is a 400.
func AdmissionHandler(decide func(*admissionv1.AdmissionRequest) *admissionv1.AdmissionResponse) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		var review admissionv1.AdmissionReview
		if err := json.Unmarshal(body, &review); err != nil || review.Request == nil {
			http.Error(w, "bad admission review", http.StatusBadRequest)
			return
		}
		resp := decide(review.Request)
		resp.UID = review.Request.UID
		out, err := json.Marshal(admissionv1.AdmissionReview{TypeMeta: review.TypeMeta, Response: resp})
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(out)
	}
}
